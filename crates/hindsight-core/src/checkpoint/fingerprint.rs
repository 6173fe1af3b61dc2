//! Full-content fingerprints of host buffers.
//!
//! A save may skip a tensor only when its whole content is proven equal to
//! what the previous save staged: version counters miss `.data` writes, numpy
//! views and shared storages. Proving it by a cryptographic hash would cost
//! as much as saving again, so the proof is xxh3-128 (tens of GB/s per core),
//! over segments of the store's chunk size: the copy in
//! [`SaveBuilder::stage_many`](crate::SaveBuilder::stage_many) computes the
//! same segments while the bytes are still in cache, so a changed tensor pays
//! for no second pass. Segment hashes are folded in order with the length.

use std::sync::atomic::{AtomicUsize, Ordering};

use twox_hash::XxHash3_128 as Xxh3;

/// Fingerprint of a whole buffer (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fingerprint(u128);

/// Bytes hashed per step while copying: small enough to be hashed from cache.
pub(crate) const COPY_STEP: usize = 256 << 10;

/// Hashes one segment incrementally, as a copy produces it.
#[derive(Clone, Default)]
pub(crate) struct SegmentHasher(Xxh3);

impl std::fmt::Debug for SegmentHasher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SegmentHasher")
    }
}

impl SegmentHasher {
    pub(crate) fn update(&mut self, bytes: &[u8]) {
        self.0.write(bytes);
    }

    pub(crate) fn finish(&self) -> u128 {
        self.0.finish_128()
    }
}

/// Fold segment hashes (in order) and the total length into a fingerprint.
pub(crate) fn fold(segments: impl IntoIterator<Item = u128>, len: u64) -> Fingerprint {
    let mut h = Xxh3::new();
    for s in segments {
        h.write(&s.to_le_bytes());
    }
    h.write(&len.to_le_bytes());
    Fingerprint(h.finish_128())
}

/// Fingerprint `data` cut into `segment`-byte pieces, on up to `threads` threads.
/// Equal to the fingerprint `stage_many` reports for the same bytes when
/// `segment` is the store's chunk size.
pub fn fingerprint(data: &[u8], segment: usize, threads: usize) -> Fingerprint {
    fingerprint_many(&[data], segment, threads)
        .pop()
        .unwrap_or_else(|| fold([], 0))
}

/// Fingerprints of several buffers, sharing `threads` threads across all
/// their segments (many small tensors parallelise as well as one large one).
pub fn fingerprint_many(buffers: &[&[u8]], segment: usize, threads: usize) -> Vec<Fingerprint> {
    let segment = segment.max(1);
    let mut work: Vec<(usize, usize)> = Vec::new(); // (buffer, offset)
    for (b, data) in buffers.iter().enumerate() {
        work.extend((0..data.len()).step_by(segment).map(|off| (b, off)));
    }
    let hashes: Vec<std::sync::OnceLock<u128>> =
        (0..work.len()).map(|_| Default::default()).collect();
    let next = AtomicUsize::new(0);
    let run = || loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        let Some(&(b, off)) = work.get(i) else { return };
        let data = buffers[b];
        let end = data.len().min(off + segment);
        let _ = hashes[i].set(Xxh3::oneshot(&data[off..end]));
    };
    let total: usize = buffers.iter().map(|b| b.len()).sum();
    // Threads cost ~20 us to start: not worth it for a few MiB.
    let threads = if total < (8 << 20) {
        1
    } else {
        threads.clamp(1, 64).min(work.len().max(1))
    };
    // Scoped threads, not rayon: a global pool does not survive fork(), and
    // a DataLoader worker forked from the trainer that hashed through it
    // would wait forever on threads that are not there (the lesson of
    // tokenizers). Scoped threads exist only during this call.
    std::thread::scope(|s| {
        for _ in 1..threads {
            s.spawn(run);
        }
        run();
    });
    // Every segment was hashed: the scope above joined all its threads, and
    // a thread that panicked re-raised the panic at the join.
    let mut hashes = hashes.into_iter().map(|h| h.into_inner().unwrap_or(0));
    buffers
        .iter()
        .map(|data| {
            let n = data.len().div_ceil(segment);
            fold(hashes.by_ref().take(n), data.len() as u64)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn streamed(data: &[u8], segment: usize) -> Fingerprint {
        let segs = data.chunks(segment).map(|c| {
            let mut h = SegmentHasher::default();
            for piece in c.chunks(COPY_STEP.min(segment).max(1) / 3 + 1) {
                h.update(piece);
            }
            h.finish()
        });
        fold(segs.collect::<Vec<_>>(), data.len() as u64)
    }

    #[test]
    fn streaming_equals_one_shot_and_threads_do_not_matter() {
        let data: Vec<u8> = (0..(9 << 20) + 77).map(|i| (i * 31 % 251) as u8).collect();
        let one = fingerprint(&data, 1 << 20, 1);
        assert_eq!(one, fingerprint(&data, 1 << 20, 4));
        assert_eq!(one, streamed(&data, 1 << 20));
        assert_ne!(
            one,
            fingerprint(&data, 2 << 20, 1),
            "segment size is part of it"
        );
    }

    #[test]
    fn empty_and_many() {
        let a = vec![1u8; 100];
        let b: Vec<u8> = Vec::new();
        let fps = fingerprint_many(&[&a, &b, &a], 64, 2);
        assert_eq!(fps[0], fps[2]);
        assert_eq!(fps[1], fingerprint(&b, 64, 1));
        assert_ne!(fps[0], fps[1]);
    }

    /// The fingerprint stored in every manifest, computed by another
    /// xxh3 implementation: checkpoints saved before the hash crate
    /// changed keep proving their content (sizes around the 240-byte,
    /// stripe and block boundaries, and above a segment).
    #[test]
    fn the_format_is_the_reference_xxh3_128() {
        use xxhash_rust::xxh3::{xxh3_128, Xxh3 as Reference};
        for len in [
            0usize,
            1,
            16,
            17,
            128,
            129,
            240,
            241,
            1024,
            1025,
            70_000,
            (1 << 20) + 3,
        ] {
            let data: Vec<u8> = (0..len).map(|i| (i * 131 % 253) as u8).collect();
            let segment = 64 << 10;
            let mut folded = Reference::new();
            for seg in data.chunks(segment) {
                folded.update(&xxh3_128(seg).to_le_bytes());
            }
            folded.update(&(len as u64).to_le_bytes());
            assert_eq!(
                fingerprint(&data, segment, 1),
                Fingerprint(folded.digest128()),
                "{len} bytes"
            );
            assert_eq!(
                streamed(&data, segment),
                Fingerprint(folded.digest128()),
                "{len} bytes, streamed"
            );
        }
    }

    proptest! {
        /// Any single changed byte, anywhere, changes the fingerprint.
        #[test]
        fn one_byte_changes_it(len in 1usize..20_000, pos in any::<usize>(), delta in 1u8..=255) {
            let data: Vec<u8> = (0..len).map(|i| (i * 7 % 256) as u8).collect();
            let mut changed = data.clone();
            let p = pos % len;
            changed[p] = changed[p].wrapping_add(delta);
            prop_assert_ne!(fingerprint(&data, 4096, 2), fingerprint(&changed, 4096, 2));
        }

        /// Moving bytes between segments, or truncating, changes it too.
        #[test]
        fn length_and_order_matter(len in 2usize..10_000) {
            let data: Vec<u8> = (0..len).map(|i| (i % 13) as u8).collect();
            let fp = fingerprint(&data, 1024, 1);
            prop_assert_ne!(fp, fingerprint(&data[..len - 1], 1024, 1));
            let mut rotated = data.clone();
            rotated.rotate_left(1);
            if rotated != data {
                prop_assert_ne!(fp, fingerprint(&rotated, 1024, 1));
            }
        }
    }
}
