//! The fingerprint that proves a device tensor unchanged between two saves.
//!
//! The Python layer computes it on the device with plain tensor reductions
//! (only 32 bytes cross to the host); this module computes the *same*
//! function over host bytes. A save of a changed device tensor copies it to
//! pinned host memory anyway, so its fingerprint is computed here, from that
//! copy, by the writer's threads, chunk by chunk as they write it (the sums
//! are order-free, [`DeviceFpSum`]): the training thread launches no
//! fingerprint work for a tensor that changed (on an H100, launching it cost
//! ~0.6 ms per 64 MiB tensor, the bulk of a save's blocked time). Only a
//! tensor whose version counter says "unchanged" is fingerprinted on the
//! device, at the next save, and compared with the one computed here.
//!
//! The function: the bytes as little-endian 64-bit words, cut into blocks of
//! [`BLOCK_WORDS`]; per block two lanes of wrapping sums of word x odd
//! multiplier (lane 1 first mixes high bits into low ones), each block's sum
//! weighted by an odd constant of its position; the trailing bytes (length
//! not a multiple of 8) summed separately; the length last. Odd multipliers
//! make every single-word change visible; pseudo-random ones make
//! structured changes (swaps, moved blocks) collide only by chance.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::OnceLock;

/// Words per block: bounds the device's temporaries (16 bytes per word).
pub const BLOCK_WORDS: usize = 1 << 22;

/// The fingerprint: lane 0, lane 1, the trailing bytes' sum, the length.
pub type DeviceFingerprint = [i64; 4];

const SEED: u64 = 0x6869_6E64_7369_6768;
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The multipliers, lane-major (`2 x BLOCK_WORDS`, all odd), built once per
/// process (64 MiB): the device side uploads this very table.
pub fn multipliers() -> &'static [i64] {
    static TABLE: OnceLock<Vec<i64>> = OnceLock::new();
    TABLE.get_or_init(|| {
        (0..2 * BLOCK_WORDS as u64)
            .map(|j| (splitmix64(SEED ^ j) | 1) as i64)
            .collect()
    })
}

/// Block `b`'s weight: odd, different for every position.
fn block_weight(b: usize) -> i64 {
    ((b as u64 * 2 + 1).wrapping_mul(GOLDEN)) as i64
}

/// The fingerprint of `bytes` (see the module docs); equal to what the
/// device computes for a tensor holding these bytes.
pub fn device_fingerprint(bytes: &[u8]) -> DeviceFingerprint {
    let sum = DeviceFpSum::new(bytes.len());
    sum.add(0, bytes);
    sum.get().expect("every byte was added")
}

/// The lanes' contribution of the words in `bytes`, the first of which is
/// word number `first_word` of the buffer.
fn lanes(first_word: usize, bytes: &[u8]) -> (i64, i64) {
    let (m0, m1) = multipliers().split_at(BLOCK_WORDS);
    let (mut acc0, mut acc1) = (0i64, 0i64);
    let mut word = first_word;
    let mut rest = bytes;
    while !rest.is_empty() {
        // Up to the end of the block `word` is in.
        let at = word % BLOCK_WORDS;
        let n = (BLOCK_WORDS - at).min(rest.len() / 8);
        if n == 0 {
            break; // `add` passes whole words only
        }
        let (here, next) = rest.split_at(n * 8);
        let (s0, s1) = block_sums(here, &m0[at..at + n], &m1[at..at + n]);
        let k = block_weight(word / BLOCK_WORDS);
        acc0 = acc0.wrapping_add(s0.wrapping_mul(k));
        acc1 = acc1.wrapping_add(s1.wrapping_mul(k));
        word += n;
        rest = next;
    }
    (acc0, acc1)
}

/// One block's (part's) two lane sums: `words` (little-endian) times the
/// multipliers. Four independent sums per lane keep the multipliers busy
/// (4.7 GB/s on one core here, where one sum per lane gave 3.9).
fn block_sums(words: &[u8], m0: &[i64], m1: &[i64]) -> (i64, i64) {
    let word = |b: &[u8]| i64::from_le_bytes(b.try_into().expect("8 bytes"));
    let mut a = [0i64; 4];
    let mut c = [0i64; 4];
    let quads = words.chunks_exact(32);
    let rest = quads.remainder();
    for ((q, x), y) in quads.zip(m0.chunks_exact(4)).zip(m1.chunks_exact(4)) {
        for j in 0..4 {
            let w = word(&q[j * 8..j * 8 + 8]);
            a[j] = a[j].wrapping_add(w.wrapping_mul(x[j]));
            c[j] = c[j].wrapping_add((w ^ (w >> 29)).wrapping_mul(y[j]));
        }
    }
    let done = (words.len() - rest.len()) / 8;
    for ((w, x), y) in rest.chunks_exact(8).zip(&m0[done..]).zip(&m1[done..]) {
        let w = word(w);
        a[0] = a[0].wrapping_add(w.wrapping_mul(*x));
        c[0] = c[0].wrapping_add((w ^ (w >> 29)).wrapping_mul(*y));
    }
    let sum = |v: [i64; 4]| v.iter().fold(0i64, |s, x| s.wrapping_add(*x));
    (sum(a), sum(c))
}

/// The device fingerprint of a buffer, summed from its ranges in any order
/// and from any thread (every part of it is a wrapping sum). Complete once
/// every byte was added exactly once.
#[derive(Debug)]
pub struct DeviceFpSum {
    len: u64,
    lanes: [AtomicI64; 3],
    covered: AtomicU64,
    /// A range that did not start on a word (a store whose chunk size is
    /// not a multiple of 8): the sum is never complete, nothing is proven.
    unusable: AtomicBool,
}

impl DeviceFpSum {
    /// An empty sum for a buffer of `len` bytes.
    pub fn new(len: usize) -> Self {
        DeviceFpSum {
            len: len as u64,
            lanes: Default::default(),
            covered: AtomicU64::new(0),
            unusable: AtomicBool::new(false),
        }
    }

    /// Add `bytes`, which sit at byte `offset` of the buffer. A range that
    /// does not start and end on a word (or at the buffer's end) makes the
    /// sum unusable.
    pub fn add(&self, offset: usize, bytes: &[u8]) {
        let len = self.len as usize;
        let head = len - len % 8;
        let end = offset + bytes.len();
        if !offset.is_multiple_of(8) || end > len || (end != len && !end.is_multiple_of(8)) {
            self.unusable.store(true, Ordering::Relaxed);
            return;
        }
        let words_end = (offset + bytes.len()).min(head).max(offset);
        let (words, tail) = bytes.split_at(words_end - offset);
        let (a0, a1) = lanes(offset / 8, words);
        self.lanes[0].fetch_add(a0, Ordering::Relaxed);
        self.lanes[1].fetch_add(a1, Ordering::Relaxed);
        if !tail.is_empty() {
            let m0 = &multipliers()[..BLOCK_WORDS];
            let at = offset + words.len() - head;
            let t = tail.iter().zip(&m0[at..]).fold(0i64, |acc, (t, m)| {
                acc.wrapping_add(i64::from(*t).wrapping_mul(*m))
            });
            self.lanes[2].fetch_add(t, Ordering::Relaxed);
        }
        // Release: a reader that sees the whole length covered sees the sums.
        self.covered.fetch_add(bytes.len() as u64, Ordering::AcqRel);
    }

    /// The fingerprint, once every byte was added.
    pub fn get(&self) -> Option<DeviceFingerprint> {
        if self.covered.load(Ordering::Acquire) != self.len || self.unusable.load(Ordering::Relaxed)
        {
            return None;
        }
        Some([
            self.lanes[0].load(Ordering::Relaxed),
            self.lanes[1].load(Ordering::Relaxed),
            self.lanes[2].load(Ordering::Relaxed),
            self.len as i64,
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn multipliers_are_odd_and_lanes_differ() {
        let t = multipliers();
        assert_eq!(t.len(), 2 * BLOCK_WORDS);
        assert!(t.iter().take(1000).all(|m| m & 1 == 1));
        assert_ne!(t[..8], t[BLOCK_WORDS..BLOCK_WORDS + 8]);
    }

    #[test]
    fn every_single_byte_change_and_a_swap_is_seen() {
        let data: Vec<u8> = (0..4099u32).map(|i| (i * 7 + 3) as u8).collect();
        let fp = device_fingerprint(&data);
        assert_eq!(fp, device_fingerprint(&data.clone()));
        assert_eq!(fp[3], 4099);
        for i in [0, 1, 7, 8, 2048, 4095, 4096, 4098] {
            let mut u = data.clone();
            u[i] ^= 0x10;
            assert_ne!(fp, device_fingerprint(&u), "missed a change at byte {i}");
        }
        let mut swapped = data.clone();
        swapped.swap(16, 24);
        swapped.swap(17, 25);
        assert_ne!(fp, device_fingerprint(&swapped));
    }

    #[test]
    fn ranges_added_in_any_order_sum_to_the_whole() {
        let data: Vec<u8> = (0..(BLOCK_WORDS * 8 + 4096 + 5) as u64)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8)
            .collect();
        let whole = device_fingerprint(&data);
        for chunk in [4096, 1 << 20, 3 << 20] {
            let sum = DeviceFpSum::new(data.len());
            let mut ranges: Vec<(usize, &[u8])> = data
                .chunks(chunk)
                .enumerate()
                .map(|(i, c)| (i * chunk, c))
                .collect();
            ranges.reverse();
            for (i, (off, bytes)) in ranges.iter().enumerate() {
                assert_eq!(
                    sum.get(),
                    None,
                    "complete after {i} of {} ranges",
                    ranges.len()
                );
                sum.add(*off, bytes);
            }
            assert_eq!(sum.get(), Some(whole), "chunk {chunk}");
        }
        // Ranges that do not start on a word prove nothing.
        let sum = DeviceFpSum::new(data.len());
        for (i, c) in data.chunks(4100).enumerate() {
            sum.add(i * 4100, c);
        }
        assert_eq!(sum.get(), None);
    }

    #[test]
    fn a_block_moved_to_another_position_is_seen() {
        let words = 2 * BLOCK_WORDS;
        let mut data = vec![0u8; words * 8];
        for (i, w) in data.chunks_exact_mut(8).enumerate() {
            w.copy_from_slice(&((i % BLOCK_WORDS) as u64).to_le_bytes());
        }
        // Both blocks hold the same words: only the block weights tell them apart.
        let (a, b) = data.split_at(BLOCK_WORDS * 8);
        assert_eq!(a, b);
        let fp = device_fingerprint(&data);
        let mut shorter = data.clone();
        shorter.truncate(BLOCK_WORDS * 8);
        assert_ne!(fp, device_fingerprint(&shorter));
        data[8] ^= 1; // one bit in the first block
        assert_ne!(fp, device_fingerprint(&data));
    }
}
