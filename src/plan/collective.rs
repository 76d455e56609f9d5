//! The custom all-reduce's launch as the plan sees it: its grid and the bytes each block
//! moves, as `cuda/all_reduce.cu` moves them (the emulator's counters check it block by
//! block), and the plan row of the unfused row-parallel layer's all-reduce.

use super::profile::DeviceProfile;
use super::rows::{
    all_reduce_algo, collective_budget, held_segments, per_sm, us, Model, PlanRow,
    COLLECTIVE_THREADS, ELEMENT_BYTES,
};
use crate::topology::AllReduceAlgo;

/// Rows (`kMaxRmsNormBlocks` of `cuda/epilogue.cu`) past which the standalone RMSNorm's blocks
/// loop.
const RMS_NORM_MAX_BLOCKS: usize = 4096;

/// One launch of the custom all-reduce (`tpfuse_all_reduce`, one rank's) on `[rows, hidden]`
/// elements of `element_bytes` each, with its epilogue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CollectiveLaunch {
    /// One-shot or two-shot (NCCL is not a custom launch).
    pub algo: AllReduceAlgo,
    /// Rows of the message.
    pub rows: usize,
    /// Elements of a row.
    pub hidden: usize,
    /// Ranks.
    pub world: usize,
    /// The rank whose launch this is (the two-shot reduces its slice).
    pub rank: usize,
    /// The group's CTA budget (`TpGroup::blocks`).
    pub budget: usize,
    /// Bytes of an element: 2 (f16, bf16) or 4 (f32).
    pub element_bytes: u64,
    /// `+ bias` of `[hidden]`.
    pub bias: bool,
    /// `+ residual`, written back.
    pub residual: bool,
    /// RMSNorm of the sum: in the one-shot kernel; after the two-shot, a launch of its own
    /// ([`CollectiveLaunch::norm_launch_block_bytes`]).
    pub rmsnorm: bool,
    /// Bytes of each half of the packet area the group offers the all-reduce
    /// ([`TpGroup::all_reduce_packet_bytes`](crate::group::TpGroup::all_reduce_packet_bytes);
    /// 0: none): the one-shot goes by packets where they fit ([`CollectiveLaunch::packets`]).
    pub packet_bytes: usize,
}

/// `[n·b/blocks, n·(b+1)/blocks)`: block `b`'s even share of `n` items (`share` of
/// `cuda/all_reduce.cu`).
fn share(n: usize, b: usize, blocks: usize) -> (usize, usize) {
    (n * b / blocks, n * (b + 1) / blocks)
}

impl CollectiveLaunch {
    /// Elements of a 16-byte vector.
    fn vector(&self) -> usize {
        16 / self.element_bytes as usize
    }

    /// Elements of an RMSNorm segment (`kSegment`: a vector per thread of a block).
    fn segment(&self) -> usize {
        COLLECTIVE_THREADS * self.vector()
    }

    /// Segments of a row.
    fn per_row(&self) -> usize {
        self.hidden.div_ceil(self.segment())
    }

    /// Whether the one-shot goes by packets (`one_shot_by_packets`,
    /// `cuda/all_reduce_packets.cu`): the group offers them, the message is whole 16-byte
    /// vectors, every rank's packets (8 bytes for 4 of data) fit half the packet area, and
    /// with RMSNorm a row is at most two segments (a block holds it).
    pub fn packets(&self) -> bool {
        let bytes = self.rows * self.hidden * self.element_bytes as usize;
        self.algo == AllReduceAlgo::OneShot
            && self.packet_bytes != 0
            && bytes % 16 == 0
            && (!self.rmsnorm || self.per_row() <= 2)
            && 2 * self.world * bytes <= self.packet_bytes
    }

    /// Whether the one-shot normalises each row in one block from registers (a row of one
    /// segment; by packets, of two at most) rather than by segments whose blocks meet.
    pub fn whole_rows(&self) -> bool {
        self.algo == AllReduceAlgo::OneShot
            && self.rmsnorm
            && (self.per_row() == 1 || self.packets())
    }

    /// The launch's blocks: one per 512 vectors of the message, 1 ..= the budget; the one-shot
    /// with RMSNorm no more than its rows (by packets, or rows of one segment), and over rows
    /// of several segments by flags one per segment up to the budget (`launch_all_reduce`).
    pub fn grid(&self) -> usize {
        let budget = self.budget.max(1);
        let vectors = (self.rows * self.hidden).div_ceil(self.vector());
        let grid = vectors.div_ceil(COLLECTIVE_THREADS).clamp(1, budget);
        let units = self.rows * self.per_row();
        match (self.algo, self.rmsnorm) {
            (AllReduceAlgo::OneShot, true) if self.packets() => grid.min(self.rows),
            (AllReduceAlgo::OneShot, true) if self.per_row() > 1 => units.min(budget),
            (AllReduceAlgo::OneShot, true) => grid.min(units),
            _ => grid,
        }
    }

    /// Bytes per element of a reduced range: the W stagings read, out written, the bias read,
    /// the residual read and written.
    fn reduce_per_element(&self) -> u64 {
        (self.world + 1 + usize::from(self.bias) + 2 * usize::from(self.residual)) as u64
    }

    /// Global-memory bytes (read + written) of each block of the launch (index =
    /// `blockIdx.x`), as `cuda/all_reduce.cu` moves them. One-shot: the block's share (of
    /// vectors, or with RMSNorm of row segments) staged (read, written), reduced from the W
    /// stagings through the epilogue into out; RMSNorm over rows of one segment: gamma's row
    /// once (loaded before the first barrier), each row normalised from registers and out
    /// written once; over rows of several, a block of one segment: its gamma, its partial (4
    /// bytes written), the row's partials read by every thread, the segment normalised from
    /// registers (out written once); a block of several: each segment's sum of squares (out
    /// read), its partial, the row's partials, the segment normalised (out and gamma read, out
    /// written again). Two-shot: the block's chunk of every rank's slice staged, its chunk of
    /// this rank's slice reduced into out and the published result, the chunks of the other
    /// slices gathered into out (and the residual, from the same loads).
    pub fn block_bytes(&self) -> Vec<u64> {
        let grid = self.grid();
        let s = self.element_bytes;
        let v = self.vector();
        let n = self.rows * self.hidden;
        match self.algo {
            AllReduceAlgo::OneShot if self.packets() => (0..grid)
                .map(|b| self.packets_block(b, grid, n, v, s))
                .collect(),
            AllReduceAlgo::OneShot => (0..grid)
                .map(|b| self.one_shot_block(b, grid, n, v, s))
                .collect(),
            AllReduceAlgo::TwoShot => (0..grid)
                .map(|b| self.two_shot_block(b, grid, n, v, s))
                .collect(),
            AllReduceAlgo::Nccl => Vec::new(),
        }
    }

    fn one_shot_block(&self, b: usize, grid: usize, n: usize, v: usize, s: u64) -> u64 {
        let (seg, per_row) = (self.segment(), self.per_row());
        // Segment u: row u / per_row, from (u % per_row)·seg, to the row's end at most.
        let begin = |u: usize| (u / per_row) * self.hidden + (u % per_row) * seg;
        let end = |u: usize| (begin(u) + seg).min((u / per_row + 1) * self.hidden);
        let (first, last, len) = if self.rmsnorm {
            let (u0, u1) = share(self.rows * per_row, b, grid);
            let len = if u0 < u1 { end(u1 - 1) - begin(u0) } else { 0 };
            (u0, u1, len)
        } else {
            let (u0, u1) = share(n.div_ceil(v), b, grid);
            (u0, u1, (u1 * v).min(n) - (u0 * v).min(n))
        };
        let len = len as u64;
        let mut bytes = 2 * len * s + self.reduce_per_element() * len * s;
        // A segment's partial written, and the row's partials read by every thread.
        let partials = 4 + (COLLECTIVE_THREADS * per_row * 4) as u64;
        if self.whole_rows() {
            bytes += self.hidden as u64 * s;
        } else if self.rmsnorm && last - first == 1 {
            // One segment, held in registers: its gamma, then the partials.
            bytes += (end(first) - begin(first)) as u64 * s + partials;
        } else if self.rmsnorm {
            for u in first..last {
                let segment = (end(u) - begin(u)) as u64;
                bytes += 4 * segment * s + partials;
            }
        }
        bytes
    }

    /// By packets: the block's share (of vectors, or with RMSNorm of rows) read once and
    /// stored as packets into every rank's half (8 bytes for every 4: twice its bytes, W
    /// times), every rank's packets read once (a packet not there yet is read again: the
    /// emulator counts each poll) and cleared, through the epilogue (bias, residual read and
    /// written) into out; with RMSNorm gamma's row read once a row.
    fn packets_block(&self, b: usize, grid: usize, n: usize, v: usize, s: u64) -> u64 {
        let len = if self.rmsnorm {
            let (r0, r1) = share(self.rows, b, grid);
            (r1 - r0) * self.hidden
        } else {
            let (u0, u1) = share(n / v, b, grid);
            (u1 - u0) * v
        } as u64;
        let w = self.world as u64;
        let epilogue = u64::from(self.bias) + 2 * u64::from(self.residual);
        let gamma = if self.rmsnorm { len } else { 0 };
        (2 + 6 * w + epilogue) * len * s + gamma * s
    }

    fn two_shot_block(&self, b: usize, grid: usize, n: usize, v: usize, s: u64) -> u64 {
        let vectors = n.div_ceil(v);
        // Block b's chunk of rank p's slice, in elements (`chunk`).
        let chunk = |p: usize| {
            let (s0, s1) = share(vectors, p, self.world);
            let (c0, c1) = share(s1 - s0, b, grid);
            (((s0 + c1) * v).min(n) - ((s0 + c0) * v).min(n)) as u64
        };
        let staged: u64 = (0..self.world).map(chunk).sum();
        let own = chunk(self.rank);
        let gathered = staged - own;
        let residual = u64::from(self.residual);
        2 * staged * s + (self.reduce_per_element() + 1) * own * s + (2 + residual) * gathered * s
    }

    /// The two-shot's RMSNorm, a launch of its own after it (`rms_norm_kernel`: a block per
    /// row, looping past 4096): per block, each of its rows' sum of squares (read), then the
    /// row normalised (read, gamma read, written); a row it holds read once with gamma and
    /// normalised from registers (`rms_norm_held_row`, [`Self::norm_held`]). Empty without RMSNorm or for
    /// the one-shot.
    pub fn norm_launch_block_bytes(&self) -> Vec<u64> {
        if !self.rmsnorm || self.algo != AllReduceAlgo::TwoShot {
            return Vec::new();
        }
        let grid = self.rows.min(RMS_NORM_MAX_BLOCKS);
        let per_element = if self.norm_held() { 3 } else { 4 };
        (0..grid)
            .map(|b| {
                let rows = (b..self.rows).step_by(grid).count() as u64;
                rows * per_element * self.hidden as u64 * self.element_bytes
            })
            .collect()
    }

    /// Whether the standalone RMSNorm holds a row in registers (`rms_norm_held_row`: a row of
    /// at most two segments of 16-bit elements, one of f32): one load phase, not two a
    /// segment.
    pub fn norm_held(&self) -> bool {
        self.per_row() <= held_segments(COLLECTIVE_THREADS, self.element_bytes)
    }

    /// Loads each thread of the reduction keeps in flight: a vector from each of the W ranks
    /// and the epilogue's bias and residual vectors, all issued before the first add
    /// (`reduce_vector`; `scripts/check-sass.sh` counts them in the SASS); by packets, a wave
    /// of up to four ranks' four packets, two 16-byte loads a rank (`sum_packet_vector`).
    pub fn loads_in_flight_per_thread(&self) -> usize {
        let ranks = if self.packets() {
            2 * self.world.min(4)
        } else {
            self.world
        };
        ranks + usize::from(self.bias) + usize::from(self.residual)
    }

    /// Load phases a block waits one after the other (each at least one memory latency): the
    /// stage's loads, the reduction's; with RMSNorm over several segments a row, the partials
    /// (a block of one segment keeps it in registers) or, where a block has several, the sum
    /// of squares, the partials and the normalisation (whole rows: none more, gamma is loaded
    /// before and the row is in registers); the two-shot's gather.
    pub fn load_phases(&self) -> usize {
        let one_segment_a_block = self.grid() == self.rows * self.per_row();
        match self.algo {
            // The input's loads, then the packets' (their arrival is the round).
            AllReduceAlgo::OneShot if self.packets() => 2,
            AllReduceAlgo::OneShot if self.rmsnorm && !self.whole_rows() && one_segment_a_block => {
                3
            }
            AllReduceAlgo::OneShot if self.rmsnorm && !self.whole_rows() => 5,
            AllReduceAlgo::OneShot => 2,
            AllReduceAlgo::TwoShot => 3,
            AllReduceAlgo::Nccl => 0,
        }
    }

    /// Synchronisation rounds on the critical path: the one-shot's barrier (and the meeting
    /// of the rank's blocks, RMSNorm over several segments a row), the two-shot's two. No
    /// barrier closes a launch: the next custom launch waits for the peers' announcements that
    /// they finished this one (`cuda/barrier.cuh`, "Finished launches"), which travel while
    /// the stream runs the layer's other kernels, so the model charges that wait nothing.
    pub fn rounds(&self) -> usize {
        match self.algo {
            // No barrier: the packets' crossing, charged as a round as the fused row's are
            // (`tpfuse::plan::fused_row`). The emulator counts no barrier.
            AllReduceAlgo::OneShot if self.packets() => 1,
            AllReduceAlgo::OneShot if self.rmsnorm && !self.whole_rows() => 2,
            AllReduceAlgo::OneShot => 1,
            AllReduceAlgo::TwoShot => 2,
            AllReduceAlgo::Nccl => 0,
        }
    }
}

/// The row of an all-reduce of `[m, n]` on `tp` ranks: with `rmsnorm`, the unfused
/// row-parallel layer's (`all_reduce_residual_rmsnorm`: the residual added and written back,
/// RMSNorm over rows of `n`), else a plain all-reduce; the one-shot by packets where
/// `packet_bytes` (the group's offer: [`CollectiveLaunch::packet_bytes`]) holds them.
pub fn all_reduce_row(
    layer: &str,
    m: usize,
    n: usize,
    tp: usize,
    p: &DeviceProfile,
    rmsnorm: bool,
    packet_bytes: usize,
) -> PlanRow {
    let bytes = (m * n) as u64 * ELEMENT_BYTES;
    let algo = all_reduce_algo(bytes as usize, tp, p);
    let w = tp as f64;
    let share = (w - 1.0) / w;
    // The minimum: its partial read, the peers' (W-1)/W of the sum in and its share out
    // (2·(W-1)/W·m·n across the link), the output written; with the epilogue the residual
    // read and written, gamma read.
    let peer_min = 2.0 * share * bytes as f64;
    let local_min = if rmsnorm {
        4 * bytes + n as u64 * ELEMENT_BYTES
    } else {
        2 * bytes
    } as f64;
    let floor = (local_min / p.dram_bytes_per_s).max(peer_min / p.link_bytes_per_s) + p.round_s;
    let launch = CollectiveLaunch {
        algo,
        rows: m,
        hidden: n,
        world: tp,
        rank: 0,
        budget: collective_budget(p, tp),
        element_bytes: ELEMENT_BYTES,
        bias: false,
        residual: rmsnorm,
        rmsnorm,
        packet_bytes,
    };
    let packets = launch.packets();
    // By packets each rank's data crosses to every peer as packets (twice its bytes).
    let crossings = if packets { 2.0 } else { 1.0 };
    let (per_block, peer_bytes, config) = match algo {
        AllReduceAlgo::OneShot => (
            launch.block_bytes(),
            crossings * (w - 1.0) * bytes as f64,
            "one-shot",
        ),
        AllReduceAlgo::TwoShot => (launch.block_bytes(), 2.0 * share * bytes as f64, "two-shot"),
        // NCCL: modelled as a ring, 2(W-1) steps, its bytes spread evenly over the budget.
        AllReduceAlgo::Nccl => {
            let per_elem = 2.0 + 4.0 * share;
            let grid = launch.grid();
            let each = (per_elem * bytes as f64 / grid as f64).round() as u64;
            (vec![each; grid], 2.0 * share * bytes as f64, "nccl")
        }
    };
    let (max, mean, streaming) = per_sm(&per_block, p.sms);
    let total: u64 = per_block.iter().sum();
    let in_flight = match algo {
        AllReduceAlgo::Nccl => (COLLECTIVE_THREADS * 16) as u64,
        _ => (COLLECTIVE_THREADS * 16 * launch.loads_in_flight_per_thread()) as u64,
    };
    let (rounds, phases) = match algo {
        AllReduceAlgo::Nccl => (2 * (tp - 1), 1),
        _ => (launch.rounds(), launch.load_phases()),
    };
    let model = Model {
        launches: 1,
        dram_bytes: total as f64,
        peer_bytes,
        busiest_sm_bytes: max as f64,
        // By packets every load is of this GPU's memory (the crossing is the round).
        peer_share: if packets {
            0.0
        } else {
            peer_bytes / total.max(1) as f64
        },
        streams_weights: false,
        in_flight: in_flight as f64,
        chain_s: 0.0,
        rounds,
        // The load phases after the first, each a latency the block waits before the next.
        serial_s: (phases - 1) as f64 * p.dram_latency_s,
    };
    // The standalone RMSNorm after the two-shot and NCCL: its own launch, a block per row.
    let norm_s = if rmsnorm && algo != AllReduceAlgo::OneShot {
        let norm_launch = CollectiveLaunch {
            algo: AllReduceAlgo::TwoShot,
            ..launch
        };
        let norm = norm_launch.norm_launch_block_bytes();
        let (norm_max, _, _) = per_sm(&norm, p.sms);
        Model {
            launches: 1,
            dram_bytes: norm.iter().sum::<u64>() as f64,
            peer_bytes: 0.0,
            busiest_sm_bytes: norm_max as f64,
            peer_share: 0.0,
            streams_weights: false,
            // A held row: its x and gamma vectors a thread, loaded together; else one vector.
            in_flight: (COLLECTIVE_THREADS * 16) as f64
                * if norm_launch.norm_held() {
                    2.0 * norm_launch.per_row() as f64
                } else {
                    1.0
                },
            chain_s: 0.0,
            rounds: 0,
            // The sum of squares, then the normalisation (a held row: one load phase).
            serial_s: if norm_launch.norm_held() {
                0.0
            } else {
                p.dram_latency_s
            },
        }
        .seconds(p)
    } else {
        0.0
    };
    PlanRow {
        layer: layer.to_string(),
        op: "all_reduce".into(),
        m,
        n,
        k: 0,
        tp,
        config: config.into(),
        split_k: 1,
        blocks: per_block.len(),
        sms: p.sms,
        sms_streaming: streaming,
        bytes_per_sm_max: max,
        bytes_per_sm_mean: mean,
        bytes_in_flight_per_sm: in_flight,
        sync_rounds: rounds,
        floor_us: us(floor),
        model_us: us(model.seconds(p) + norm_s),
        choice: match algo {
            AllReduceAlgo::Nccl => "NCCL (no custom kernels here), modelled as a ring".into(),
            _ if packets => format!("{config} by packets: the all-reduce rule at {bytes} B"),
            _ => format!("{config}: the all-reduce rule at {bytes} B"),
        },
    }
}
