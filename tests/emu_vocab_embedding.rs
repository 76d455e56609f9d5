//! `tpfuse_vocab_embedding` (one rank's masked lookup of the vocabulary-parallel embedding) on
//! the CPU emulator (feature `emulator`), through the C ABI, f16 and bf16.
//!
//! Every case: a table of fresh random 16-bit patterns (seeded; `TPFUSE_TEST_SEED` changes
//! them) with +0.0 and -0.0 planted in it, outputs poisoned first, and ids of every kind: the
//! rank's first and last rows, rows of other ranks below and above its range, padding rows of
//! its own range (at or past `vocab`), ids far past the table and `u32::MAX`. Each output row
//! must be, bit for bit, the table's row, all -0.0 (another rank's token) or all the type's
//! quiet NaN (no rank's token). Shapes: hidden of one vector, of a tail of vectors past the
//! block's 128 threads; more tokens than blocks (the grid-stride loop). Bad calls (f32, a
//! hidden that is not whole vectors, misaligned pointers) return cudaErrorInvalidValue and
//! write nothing.
#![cfg(feature = "emulator")]

mod common;
use common::emu::{launched, session};
use common::gpu::{base_seed, mix_seed, splitmix64};
use tpfuse::emulator::{abi, DeviceBuffer, Stream};

const F16: i32 = abi::TPFUSE_DTYPE_F16 as i32;
const BF16: i32 = abi::TPFUSE_DTYPE_BF16 as i32;
const POISON: u16 = 0x5a5a;
const NEG_ZERO: u16 = 0x8000;

fn nan_bits(dtype: i32) -> u16 {
    if dtype == F16 {
        0x7e00
    } else {
        0x7fc0
    }
}

/// One rank's part of the vocabulary: rows `row_begin .. row_begin + rows` of a padded table,
/// tokens below `vocab` valid.
struct Part {
    row_begin: u32,
    rows: u32,
    vocab: u32,
}

/// Ids of every kind for `part`, then random valid ones up to `m` in all.
fn ids_for(part: &Part, m: usize, seed: u64) -> Vec<u32> {
    let Part {
        row_begin,
        rows,
        vocab,
    } = *part;
    let mut ids = vec![
        row_begin,
        row_begin + rows - 1,
        vocab - 1,
        0,
        u32::MAX,
        vocab,
    ];
    if row_begin > 0 {
        ids.push(row_begin - 1);
    }
    ids.push(row_begin + rows);
    // A padding row of the rank's own range (a row the table holds, but no token).
    if vocab < row_begin + rows {
        ids.push(vocab.max(row_begin));
    }
    let mut s = seed;
    while ids.len() < m {
        s = splitmix64(s);
        ids.push((s % u64::from(vocab)) as u32);
    }
    ids.truncate(m);
    ids
}

fn run_case(stream: &Stream, dtype: i32, part: &Part, hidden: usize, m: usize, seed: u64) {
    let label = format!(
        "dtype {dtype} rows {}..+{} vocab {} hidden {hidden} m {m} seed {seed:#x}",
        part.row_begin, part.rows, part.vocab
    );
    let rows = part.rows as usize;
    let mut s = seed;
    let mut table: Vec<u16> = (0..rows * hidden)
        .map(|_| {
            s = splitmix64(s);
            s as u16
        })
        .collect();
    // Signed zeros, which a sum with +0.0 (instead of -0.0) for the other ranks would change.
    for i in (0..table.len()).step_by(7) {
        table[i] = if i % 2 == 0 { NEG_ZERO } else { 0 };
    }
    let ids = ids_for(part, m, splitmix64(seed ^ 0x1d5));
    let table_dev = DeviceBuffer::from_slice(&table);
    let ids_dev = DeviceBuffer::from_slice(&ids);
    let out = DeviceBuffer::from_slice(&vec![POISON; m * hidden]);
    // SAFETY: the buffers hold [rows, hidden], [m] and [m, hidden] elements and outlive the
    // synchronize below.
    let code = unsafe {
        abi::tpfuse_vocab_embedding(
            dtype,
            table_dev.ptr().cast(),
            ids_dev.ptr(),
            out.ptr().cast(),
            m,
            hidden,
            u64::from(part.row_begin),
            u64::from(part.rows),
            u64::from(part.vocab),
            stream.raw(),
        )
    };
    launched(&label, code);
    stream.synchronize().expect("the lookup on the emulator");
    let got = out.to_vec();
    for (i, &id) in ids.iter().enumerate() {
        let row = &got[i * hidden..(i + 1) * hidden];
        let offset = id.wrapping_sub(part.row_begin);
        let want: Vec<u16> = if id < part.vocab && offset < part.rows {
            let o = offset as usize;
            table[o * hidden..(o + 1) * hidden].to_vec()
        } else if id < part.vocab {
            vec![NEG_ZERO; hidden]
        } else {
            vec![nan_bits(dtype); hidden]
        };
        if row != want.as_slice() {
            let j = (0..hidden).find(|&j| row[j] != want[j]).unwrap_or(0);
            panic!(
                "{label}: token {i} (id {id}): element {j} is {:#06x}, want {:#06x}",
                row[j], want[j]
            );
        }
    }
}

#[test]
fn lookup_copies_the_rank_s_rows_and_masks_the_rest() {
    let _s = session(
        "emu_vocab_embedding",
        "lookup_copies_the_rank_s_rows_and_masks_the_rest",
    );
    let seed = base_seed(0x766f_6361_6200_0001);
    let stream = Stream::new();
    // Rank 1 of 3 with a full range; the last rank of 4 with padding rows (vocab 200 of 256);
    // rank 0 (row_begin 0).
    let parts = [
        Part {
            row_begin: 64,
            rows: 64,
            vocab: 190,
        },
        Part {
            row_begin: 192,
            rows: 64,
            vocab: 200,
        },
        Part {
            row_begin: 0,
            rows: 128,
            vocab: 1000,
        },
    ];
    let mut n = 0u64;
    for dtype in [F16, BF16] {
        for part in &parts {
            // One vector per row; 130 vectors (past the block's 128 threads); many tokens
            // (past the 64 blocks of 8 SMs).
            for (hidden, m) in [(8, 9), (1040, 12), (24, 150)] {
                n += 1;
                run_case(&stream, dtype, part, hidden, m, mix_seed(seed, &[n]));
            }
        }
    }
}

#[test]
fn bad_calls_are_refused_and_write_nothing() {
    let _s = session(
        "emu_vocab_embedding",
        "bad_calls_are_refused_and_write_nothing",
    );
    let stream = Stream::new();
    let table = DeviceBuffer::from_slice(&[1u16; 64 * 16]);
    let ids = DeviceBuffer::from_slice(&[0u32, 1, 2, 3]);
    let out = DeviceBuffer::from_slice(&[POISON; 4 * 16 + 8]);
    let invalid = 1; // cudaErrorInvalidValue
    let call = |dtype: i32, table: *const u16, ids: *const u32, out: *mut u16, hidden: usize| {
        // SAFETY: every pointer stays inside its buffer for the sizes given (4 tokens of at
        // most 16 elements, rows 0..64), or the call is refused before reading it.
        unsafe {
            abi::tpfuse_vocab_embedding(
                dtype,
                table.cast(),
                ids,
                out.cast(),
                4,
                hidden,
                0,
                64,
                64,
                stream.raw(),
            )
        }
    };
    let (t, i, o) = (table.ptr(), ids.ptr(), out.ptr());
    // SAFETY (pointer offsets): inside the buffers.
    let cases = unsafe {
        [
            ("f32", call(abi::TPFUSE_DTYPE_F32 as i32, t, i, o, 16)),
            ("hidden 12", call(BF16, t, i, o, 12)),
            ("out misaligned", call(BF16, t, i, o.add(1), 16)),
            ("table misaligned", call(BF16, t.add(4), i, o, 8)),
            (
                "ids misaligned",
                call(F16, t, i.cast::<u8>().add(2).cast(), o, 16),
            ),
        ]
    };
    for (what, code) in cases {
        assert_eq!(code, invalid, "{what}: want cudaErrorInvalidValue");
    }
    stream.synchronize().expect("nothing launched");
    assert!(
        out.to_vec().iter().all(|&b| b == POISON),
        "a refused call wrote to out"
    );
}
