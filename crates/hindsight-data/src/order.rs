//! The order and identity of an input job.
//!
//! Everything here is pure, stateless arithmetic shared by the dispatcher,
//! the workers and the training clients, so that all of them agree on which
//! example sits at which position of which epoch without talking to each
//! other. This module is the only owner of these rules: change nothing here
//! without a new format tag, or resumed jobs will silently see other data.

use std::ops::Range;

use serde::{Deserialize, Serialize};

/// Why a job spec or a rank request was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OrderError {
    /// A field of the [`JobSpec`] is out of its domain.
    #[error("input job: {field} {reason}")]
    Invalid {
        /// The offending field, as named in [`JobSpec`].
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A rank that does not exist in the world.
    #[error("input job: rank {rank} is not below the world size {world}")]
    Rank {
        /// The rank asked for.
        rank: u32,
        /// The world size it was asked against.
        world: u32,
    },
}

/// What makes two attachments the same input job.
///
/// The geometry methods never panic; on a spec that fails
/// [`validate`](JobSpec::validate) (a zero batch or split size) they describe
/// an empty epoch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSpec {
    /// The dataset factory, `"module:factory"`.
    pub dataset: String,
    /// Canonical JSON of the factory's arguments (`"{}"` if none).
    pub dataset_args: String,
    /// A digest of the dataset code, given by the caller.
    pub code_version: String,
    /// The seed of the shuffle and of every per-example random draw.
    pub seed: u64,
    /// Examples in the dataset.
    pub length: u64,
    /// Examples per global batch (all ranks together), at least 1.
    pub global_batch: u64,
    /// Global batches per split (the unit of assignment and failover), at least 1.
    pub split_batches: u64,
    /// Drop the last, short batch of each epoch.
    pub drop_last: bool,
    /// Shuffle each epoch; otherwise positions are dataset indices.
    pub shuffle: bool,
    /// Record counts of the shards of a sharded dataset (read sequentially
    /// with `open(shard, offset)`); empty for a map-style dataset.
    #[serde(default)]
    pub shards: Vec<u64>,
}

/// Versions the [`JobSpec::job_id`] encoding: bump it with any change to it.
const JOB_FORMAT: &str = "hindsight-data/job/v1";

impl JobSpec {
    /// Checks the fields the geometry divides by, and that there is data.
    pub fn validate(&self) -> Result<(), OrderError> {
        let invalid = |field, reason: &str| {
            Err(OrderError::Invalid {
                field,
                reason: reason.to_owned(),
            })
        };
        if self.dataset.is_empty() {
            return invalid("dataset", "must not be empty");
        }
        if self.length == 0 {
            return invalid("length", "must be at least 1");
        }
        if self.global_batch == 0 {
            return invalid("global_batch", "must be at least 1");
        }
        if self.split_batches == 0 {
            return invalid("split_batches", "must be at least 1");
        }
        let records = self
            .shards
            .iter()
            .try_fold(0u64, |sum, n| sum.checked_add(*n));
        if !self.shards.is_empty() && records != Some(self.length) {
            return invalid("shards", "record counts must add up to length");
        }
        Ok(())
    }

    /// 32 hex characters naming the job.
    ///
    /// A blake3 digest of an explicit, versioned, field-by-field encoding
    /// (not serde's), so that reordering or renaming Rust fields cannot change
    /// ids. Each field is tagged with its name and strings are length-prefixed,
    /// so no two distinct specs share an encoding.
    pub fn job_id(&self) -> String {
        let mut h = blake3::Hasher::new();
        let mut bytes = |name: &str, value: &[u8]| {
            for part in [name.as_bytes(), value] {
                h.update(&(part.len() as u64).to_le_bytes());
                h.update(part);
            }
        };
        bytes("format", JOB_FORMAT.as_bytes());
        bytes("dataset", self.dataset.as_bytes());
        bytes("dataset_args", self.dataset_args.as_bytes());
        bytes("code_version", self.code_version.as_bytes());
        bytes("seed", &self.seed.to_le_bytes());
        bytes("length", &self.length.to_le_bytes());
        bytes("global_batch", &self.global_batch.to_le_bytes());
        bytes("split_batches", &self.split_batches.to_le_bytes());
        bytes("drop_last", &[u8::from(self.drop_last)]);
        bytes("shuffle", &[u8::from(self.shuffle)]);
        // Absent for map-style jobs, so their ids stay what they were.
        if !self.shards.is_empty() {
            let counts: Vec<u8> = self.shards.iter().flat_map(|n| n.to_le_bytes()).collect();
            bytes("shards", &counts);
        }
        let mut id = h.finalize().to_hex().to_string();
        id.truncate(32);
        id
    }

    /// One `"field: ours != theirs"` per differing field, in declaration
    /// order, so a refused attach can name what differs.
    pub fn differences(&self, other: &JobSpec) -> Vec<String> {
        let mut out = Vec::new();
        // Strings are quoted so that empty or padded values stay visible.
        macro_rules! cmp {
            ($field:ident, $fmt:literal) => {
                if self.$field != other.$field {
                    out.push(format!(
                        concat!(stringify!($field), ": ", $fmt, " != ", $fmt),
                        self.$field, other.$field
                    ));
                }
            };
        }
        cmp!(dataset, "{:?}");
        cmp!(dataset_args, "{:?}");
        cmp!(code_version, "{:?}");
        cmp!(seed, "{}");
        cmp!(length, "{}");
        cmp!(global_batch, "{}");
        cmp!(split_batches, "{}");
        cmp!(drop_last, "{}");
        cmp!(shuffle, "{}");
        if self.shards != other.shards {
            let describe = |s: &[u64]| match s.len() {
                0 => "map-style".to_string(),
                n => format!("{n} shards of {} records", s.iter().sum::<u64>()),
            };
            let first = self
                .shards
                .iter()
                .zip(&other.shards)
                .position(|(a, b)| a != b);
            let at = first.map_or(String::new(), |i| {
                format!(", first difference at shard {i}")
            });
            out.push(format!(
                "shards: {} != {}{at}",
                describe(&self.shards),
                describe(&other.shards)
            ));
        }
        out
    }

    /// Global batches per epoch: the short last batch counts unless `drop_last`.
    pub fn batches_per_epoch(&self) -> u64 {
        if self.global_batch == 0 {
            return 0;
        }
        if self.drop_last {
            self.length / self.global_batch
        } else {
            self.length.div_ceil(self.global_batch)
        }
    }

    /// Splits per epoch; the last one may hold fewer batches.
    pub fn splits_per_epoch(&self) -> u64 {
        if self.split_batches == 0 {
            return 0;
        }
        self.batches_per_epoch().div_ceil(self.split_batches)
    }

    /// The split that global batch `batch` belongs to.
    pub fn split_of(&self, batch: u64) -> u64 {
        batch.checked_div(self.split_batches).unwrap_or(0)
    }

    /// The global batch ids of `split`; empty past the end of the epoch.
    pub fn split_batches(&self, split: u64) -> Range<u64> {
        let batches = self.batches_per_epoch();
        let start = split.saturating_mul(self.split_batches).min(batches);
        start..start.saturating_add(self.split_batches).min(batches)
    }

    /// The positions in the epoch order that global batch `batch` covers;
    /// empty past the end of the epoch.
    pub fn batch_positions(&self, batch: u64) -> Range<u64> {
        // With drop_last the tail positions belong to no batch.
        let end = if self.drop_last {
            self.batches_per_epoch() * self.global_batch
        } else {
            self.length
        };
        let start = batch.saturating_mul(self.global_batch).min(end);
        start..start.saturating_add(self.global_batch).min(end)
    }

    /// Rank `rank`'s slice of global batch `batch` in a world of `world`:
    /// `[start + r*n/R, start + (r+1)*n/R)` for a batch of `n` positions.
    ///
    /// The slices of all ranks concatenate to the whole batch for any world
    /// size, so what a global batch holds never depends on the world size.
    pub fn rank_positions(
        &self,
        batch: u64,
        rank: u32,
        world: u32,
    ) -> Result<Range<u64>, OrderError> {
        if rank >= world {
            return Err(OrderError::Rank { rank, world });
        }
        let whole = self.batch_positions(batch);
        let n = u128::from(whole.end - whole.start);
        // Each offset is at most n, so it fits back into u64.
        let offset = |r: u32| (n * u128::from(r) / u128::from(world)) as u64;
        Ok(whole.start + offset(rank)..whole.start + offset(rank + 1))
    }

    /// The order of `epoch`: position -> dataset index.
    pub fn permutation(&self, epoch: u64) -> Permutation {
        if self.shuffle {
            Permutation::new(self.seed, epoch, self.length)
        } else {
            Permutation::identity(self.length)
        }
    }

    /// The order of `epoch` for either kind of dataset.
    ///
    /// A sharded dataset is read sequentially, so it cannot be permuted
    /// globally: its shards are visited in a keyed order, and the records
    /// of each split (a few consecutive batches) are shuffled among
    /// themselves, like a shuffle buffer of one split. A worker then reads
    /// each split as a few contiguous runs of records.
    pub fn order(&self, epoch: u64) -> EpochOrder {
        if self.shards.is_empty() {
            return EpochOrder::Map(self.permutation(epoch));
        }
        let n = self.shards.len() as u64;
        let visit = if self.shuffle {
            Permutation::new(self.seed ^ SHARD_DOMAIN, epoch, n)
        } else {
            Permutation::identity(n)
        };
        let mut bases = Vec::with_capacity(self.shards.len());
        let mut sum = 0u64;
        for count in &self.shards {
            bases.push(sum);
            sum = sum.saturating_add(*count);
        }
        let mut starts = Vec::with_capacity(self.shards.len() + 1);
        let mut shards = Vec::with_capacity(self.shards.len());
        let mut at = 0u64;
        for slot in 0..n {
            let shard = visit.index(slot) as usize;
            starts.push(at);
            shards.push(shard);
            at = at.saturating_add(self.shards[shard]);
        }
        starts.push(at);
        EpochOrder::Sharded(ShardedOrder {
            seed: self.seed,
            epoch,
            shuffle: self.shuffle,
            len: self.length,
            split_len: self.global_batch.saturating_mul(self.split_batches).max(1),
            bases,
            starts,
            shards,
            counts: self.shards.clone(),
        })
    }
}

/// Where a record of a sharded dataset lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardOffset {
    pub shard: u64,
    pub offset: u64,
}

/// The order of one epoch: position -> dataset index (and, for a sharded
/// dataset, where that record is read).
#[derive(Debug, Clone)]
pub enum EpochOrder {
    Map(Permutation),
    Sharded(ShardedOrder),
}

/// See [`JobSpec::order`].
#[derive(Debug, Clone)]
pub struct ShardedOrder {
    seed: u64,
    epoch: u64,
    shuffle: bool,
    len: u64,
    split_len: u64,
    /// First record id of each shard, in the dataset's own shard order.
    bases: Vec<u64>,
    /// First position of each visited shard, in the epoch's visiting order
    /// (one more entry: the end).
    starts: Vec<u64>,
    /// The shard visited at each slot.
    shards: Vec<usize>,
    counts: Vec<u64>,
}

impl EpochOrder {
    /// The dataset index at `position` (a record id for a sharded dataset:
    /// shards concatenated in their own order).
    pub fn index(&self, position: u64) -> u64 {
        match self {
            EpochOrder::Map(p) => p.index(position),
            EpochOrder::Sharded(s) => {
                let at = s.locate(position);
                s.bases[at.shard as usize] + at.offset
            }
        }
    }

    /// Where the record at `position` is read; None for a map-style dataset.
    pub fn shard_offset(&self, position: u64) -> Option<ShardOffset> {
        match self {
            EpochOrder::Map(_) => None,
            EpochOrder::Sharded(s) => Some(s.locate(position)),
        }
    }
}

impl ShardedOrder {
    fn locate(&self, position: u64) -> ShardOffset {
        let q = if self.shuffle {
            let split = position / self.split_len;
            let start = split * self.split_len;
            let n = self.split_len.min(self.len.saturating_sub(start));
            let key = mix(mix(self.seed ^ SPLIT_DOMAIN) ^ split);
            start + Permutation::new(key, self.epoch, n).index(position - start)
        } else {
            position
        };
        // The last visited shard starting at or before q (empty shards
        // share a start with the next one and are skipped).
        let slot = self
            .starts
            .partition_point(|&s| s <= q)
            .saturating_sub(1)
            .min(self.shards.len().saturating_sub(1));
        let mut slot = slot;
        while slot > 0 && self.counts[self.shards[slot]] == 0 {
            slot -= 1;
        }
        ShardOffset {
            shard: self.shards[slot] as u64,
            offset: q - self.starts[slot],
        }
    }
}

/// Feistel rounds; 4 already make a strong pseudo-random permutation, the
/// rest is margin for the weak round function of tiny domains.
const ROUNDS: usize = 8;

/// Domain separation between the derived streams, so the shuffle keys and
/// the example seeds never coincide for the same numbers.
const PERMUTATION_DOMAIN: u64 = 0x6869_6e64_7065_726d; // "hindperm"
const EXAMPLE_DOMAIN: u64 = 0x6869_6e64_6578_6d70; // "hindexmp"
const SHARD_DOMAIN: u64 = 0x6869_6e64_7368_7264; // "hindshrd"
const SPLIT_DOMAIN: u64 = 0x6869_6e64_7370_6c74; // "hindsplt"

/// A stateless bijection of `0..len` keyed by `(seed, epoch)`.
///
/// O(1) memory and time per position (a Feistel network with cycle walking),
/// so any worker can compute any batch without materializing the epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Permutation {
    len: u64,
    /// Bits in each Feistel half; the network permutes `0..4^half_bits`.
    half_bits: u32,
    /// `None` for the identity.
    keys: Option<[u64; ROUNDS]>,
}

impl Permutation {
    /// The shuffle of `0..len` for `(seed, epoch)`.
    pub fn new(seed: u64, epoch: u64, len: u64) -> Permutation {
        // The smallest power of 4 (at least 4) not below len: less than
        // 4 * len, so cycle walking takes under 4 steps on average.
        let bits = 64 - len.saturating_sub(1).leading_zeros();
        let half_bits = bits.div_ceil(2).max(1);
        let base = mix(mix(seed ^ PERMUTATION_DOMAIN) ^ epoch);
        let mut keys = [0u64; ROUNDS];
        for (round, key) in (0u64..).zip(keys.iter_mut()) {
            *key = mix(base ^ round);
        }
        Permutation {
            len,
            half_bits,
            keys: Some(keys),
        }
    }

    /// The unshuffled order of `0..len`.
    pub fn identity(len: u64) -> Permutation {
        Permutation {
            len,
            half_bits: 1,
            keys: None,
        }
    }

    /// The number of positions.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether there are no positions.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The dataset index at `position`, or `None` when `position >= len`.
    pub fn get(&self, position: u64) -> Option<u64> {
        if position >= self.len {
            return None;
        }
        let Some(keys) = &self.keys else {
            return Some(position);
        };
        // Cycle walking: the network permutes a domain that contains
        // 0..len, so following the cycle through `position` must come back
        // into 0..len, and the map stays a bijection of 0..len.
        let mut x = position;
        loop {
            x = self.feistel(keys, x);
            if x < self.len {
                return Some(x);
            }
        }
    }

    /// The dataset index at `position`; requires `position < len` (checked
    /// in debug builds, otherwise the position itself comes back).
    pub fn index(&self, position: u64) -> u64 {
        debug_assert!(
            position < self.len,
            "position {position} out of a permutation of {}",
            self.len
        );
        self.get(position).unwrap_or(position)
    }

    /// One pass of the balanced Feistel network over `0..4^half_bits`.
    fn feistel(&self, keys: &[u64; ROUNDS], x: u64) -> u64 {
        let mask = (1u64 << self.half_bits) - 1;
        let (mut left, mut right) = (x >> self.half_bits, x & mask);
        for &key in keys {
            (left, right) = (right, left ^ (mix(key ^ right) & mask));
        }
        (left << self.half_bits) | right
    }
}

/// The seed of every random draw made while producing example `index` in
/// `epoch`: counter-based, so an example recomputed after a worker failure
/// draws exactly the same randomness, wherever and whenever it runs.
pub fn example_seed(seed: u64, epoch: u64, index: u64) -> u64 {
    // Chained bijective mixes: each stage sees a different, already mixed
    // state, so (epoch, index) and (index, epoch) land apart.
    mix(mix(mix(seed ^ EXAMPLE_DOMAIN) ^ epoch) ^ index)
}

/// The SplitMix64 finalizer: a bijective 64-bit mix with full avalanche.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    fn spec() -> JobSpec {
        JobSpec {
            dataset: "my_data:make".into(),
            dataset_args: r#"{"split":"train"}"#.into(),
            code_version: "abc123".into(),
            seed: 42,
            length: 1003,
            global_batch: 32,
            split_batches: 4,
            drop_last: false,
            shuffle: true,
            shards: vec![],
        }
    }

    fn assert_bijection(p: &Permutation) {
        let mut all: Vec<u64> = (0..p.len()).map(|i| p.get(i).unwrap()).collect();
        all.sort_unstable();
        assert!(
            all.iter().copied().eq(0..p.len()),
            "not a bijection of 0..{}",
            p.len()
        );
        assert_eq!(p.get(p.len()), None);
    }

    proptest! {
        #[test]
        fn permutation_is_a_bijection(seed: u64, epoch: u64, len in 0u64..3000) {
            assert_bijection(&Permutation::new(seed, epoch, len));
        }
    }

    #[test]
    fn permutation_is_a_bijection_for_every_small_len() {
        for len in 0..=70 {
            for (seed, epoch) in [(0, 0), (1, 0), (0, 1), (42, 7), (u64::MAX, u64::MAX)] {
                assert_bijection(&Permutation::new(seed, epoch, len));
            }
            assert_bijection(&Permutation::identity(len));
        }
    }

    #[test]
    fn permutation_is_keyed_by_seed_and_epoch() {
        let order = |p: Permutation| (0..1000).map(|i| p.index(i)).collect::<Vec<_>>();
        let a = order(Permutation::new(7, 0, 1000));
        assert_eq!(a, order(Permutation::new(7, 0, 1000)));
        assert_ne!(a, order(Permutation::new(7, 1, 1000)));
        assert_ne!(a, order(Permutation::new(8, 0, 1000)));
        let p = Permutation::new(7, 0, 1000);
        assert_eq!(p.clone(), p);
    }

    #[test]
    fn permutation_is_well_mixed() {
        let len = 10_000;
        let p = Permutation::new(1, 2, len);
        let order: Vec<u64> = (0..len).map(|i| p.index(i)).collect();
        let fixed = (0..len).filter(|&i| order[i as usize] == i).count();
        assert!(fixed < 20, "{fixed} fixed points");
        // Consecutive positions should not keep consecutive indices.
        let runs = order.windows(2).filter(|w| w[1] == w[0] + 1).count();
        assert!(runs < 20, "{runs} consecutive pairs");
        // And the first tenth of the epoch should spread over the dataset.
        let low = order[..1000].iter().filter(|&&i| i < len / 2).count();
        assert!((400..600).contains(&low), "{low} of 1000 in the lower half");
    }

    #[test]
    fn identity_and_tiny_permutations() {
        let id = Permutation::identity(5);
        assert!((0..5).all(|i| id.index(i) == i));
        assert_eq!(id.get(5), None);
        let empty = Permutation::new(1, 1, 0);
        assert!(empty.is_empty());
        assert_eq!(empty.get(0), None);
        let one = Permutation::new(1, 1, 1);
        assert_eq!((one.len(), one.index(0)), (1, 0));
        let mut off = spec();
        off.shuffle = false;
        assert_eq!(off.permutation(3), Permutation::identity(off.length));
        assert_eq!(spec().permutation(3), Permutation::new(42, 3, 1003));
    }

    #[test]
    fn huge_permutations_stay_in_range_and_distinct() {
        for len in [1u64 << 40, u64::MAX / 2, (1 << 62) + 1, u64::MAX] {
            let p = Permutation::new(3, 4, len);
            let mut seen = HashSet::new();
            for k in 0..10_000u64 {
                // Spread the sample over the whole domain, ends included.
                let pos = match k {
                    0 => 0,
                    1 => len - 1,
                    _ => mix(k) % len,
                };
                let i = p.index(pos);
                assert!(i < len);
                seen.insert((pos, i));
            }
            let positions: HashSet<u64> = seen.iter().map(|&(p, _)| p).collect();
            let indices: HashSet<u64> = seen.iter().map(|&(_, i)| i).collect();
            assert_eq!(positions.len(), indices.len(), "collision for len {len}");
            assert_eq!(p.get(len - 1).map(|i| i < len), Some(true));
        }
    }

    fn geometry_cases() -> Vec<JobSpec> {
        let mut out = Vec::new();
        for (length, global_batch, split_batches) in [
            (1003, 32, 4),
            (1024, 32, 4),
            (10, 3, 1),
            (7, 10, 2),
            (1, 1, 1),
            (100, 7, 3),
            (64, 64, 5),
        ] {
            for drop_last in [false, true] {
                out.push(JobSpec {
                    length,
                    global_batch,
                    split_batches,
                    drop_last,
                    ..spec()
                });
            }
        }
        out
    }

    #[test]
    fn batches_and_splits_cover_the_epoch_once() {
        for s in geometry_cases() {
            let batches = s.batches_per_epoch();
            let expect = if s.drop_last {
                s.length / s.global_batch
            } else {
                s.length.div_ceil(s.global_batch)
            };
            assert_eq!(batches, expect, "{s:?}");
            // Batches tile the epoch's positions in order, with no gap or overlap.
            let mut next = 0;
            for b in 0..batches {
                let r = s.batch_positions(b);
                assert_eq!(r.start, next, "{s:?} batch {b}");
                assert!(!r.is_empty());
                let full = r.end - r.start == s.global_batch;
                assert!(
                    full || (!s.drop_last && b == batches - 1),
                    "{s:?} batch {b} short"
                );
                next = r.end;
            }
            let covered = if s.drop_last {
                batches * s.global_batch
            } else {
                s.length
            };
            assert_eq!(next, covered, "{s:?}");
            assert!(s.batch_positions(batches).is_empty());
            // Splits tile the batches, and split_of agrees with them.
            assert_eq!(s.splits_per_epoch(), batches.div_ceil(s.split_batches));
            let mut next = 0;
            for split in 0..s.splits_per_epoch() {
                let r = s.split_batches(split);
                assert_eq!(r.start, next);
                assert!(!r.is_empty() && r.end - r.start <= s.split_batches);
                assert!(r.clone().all(|b| s.split_of(b) == split));
                next = r.end;
            }
            assert_eq!(next, batches);
            assert!(s.split_batches(s.splits_per_epoch()).is_empty());
        }
    }

    #[test]
    fn drop_last_can_leave_no_batch() {
        let s = JobSpec {
            length: 5,
            global_batch: 8,
            drop_last: true,
            ..spec()
        };
        assert_eq!((s.batches_per_epoch(), s.splits_per_epoch()), (0, 0));
        assert!(s.batch_positions(0).is_empty());
        let s = JobSpec {
            drop_last: false,
            ..s
        };
        assert_eq!((s.batches_per_epoch(), s.batch_positions(0)), (1, 0..5));
    }

    #[test]
    fn ranks_partition_each_batch_for_any_world() {
        for s in geometry_cases() {
            for b in 0..s.batches_per_epoch() {
                let whole = s.batch_positions(b);
                for world in 1..=7u32 {
                    // Concatenating the ranks in order gives back the batch, so
                    // a batch's content does not depend on the world size.
                    let mut next = whole.start;
                    for rank in 0..world {
                        let r = s.rank_positions(b, rank, world).unwrap();
                        assert_eq!(r.start, next, "{s:?} batch {b} rank {rank}/{world}");
                        let len = r.end - r.start;
                        let n = whole.end - whole.start;
                        assert!(len == n / u64::from(world) || len == n.div_ceil(u64::from(world)));
                        next = r.end;
                    }
                    assert_eq!(next, whole.end, "{s:?} batch {b} world {world}");
                }
            }
        }
        let s = JobSpec {
            length: 10,
            global_batch: 10,
            ..spec()
        };
        assert_eq!(s.rank_positions(0, 0, 3).unwrap(), 0..3);
        assert_eq!(s.rank_positions(0, 1, 3).unwrap(), 3..6);
        assert_eq!(s.rank_positions(0, 2, 3).unwrap(), 6..10);
    }

    #[test]
    fn batch_content_does_not_depend_on_world() {
        let s = spec();
        let perm = s.permutation(5);
        for b in [0, 1, s.batches_per_epoch() - 1] {
            let indices = |world: u32| -> Vec<u64> {
                (0..world)
                    .flat_map(|r| s.rank_positions(b, r, world).unwrap())
                    .map(|p| perm.index(p))
                    .collect()
            };
            let one = indices(1);
            assert_eq!(
                one.len() as u64,
                s.batch_positions(b).end - s.batch_positions(b).start
            );
            for world in 2..=7 {
                assert_eq!(indices(world), one, "batch {b} world {world}");
            }
        }
    }

    #[test]
    fn bad_ranks_are_refused() {
        let s = spec();
        for (rank, world) in [(0, 0), (3, 3), (9, 2)] {
            let err = s.rank_positions(0, rank, world).unwrap_err();
            assert!(
                matches!(err, OrderError::Rank { rank: r, world: w } if r == rank && w == world)
            );
            assert!(err.to_string().contains(&format!("rank {rank}")));
        }
    }

    #[test]
    fn validate_names_the_field() {
        assert!(spec().validate().is_ok());
        let b = spec();
        let cases = [
            (
                "dataset",
                JobSpec {
                    dataset: String::new(),
                    ..b.clone()
                },
            ),
            (
                "length",
                JobSpec {
                    length: 0,
                    ..b.clone()
                },
            ),
            (
                "global_batch",
                JobSpec {
                    global_batch: 0,
                    ..b.clone()
                },
            ),
            (
                "split_batches",
                JobSpec {
                    split_batches: 0,
                    ..b
                },
            ),
        ];
        for (field, s) in cases {
            match s.validate() {
                Err(e @ OrderError::Invalid { field: f, .. }) => {
                    assert_eq!(f, field);
                    assert!(e.to_string().starts_with(&format!("input job: {field} ")));
                }
                other => panic!("{field}: {other:?}"),
            }
            // Geometry on an invalid spec degrades to an empty epoch, never a panic.
            let _ = (
                s.batches_per_epoch(),
                s.splits_per_epoch(),
                s.split_of(3),
                s.split_batches(1),
            );
        }
    }

    /// Every single-field change, paired with the field's name.
    fn variants() -> Vec<(&'static str, JobSpec)> {
        let b = spec();
        vec![
            (
                "dataset",
                JobSpec {
                    dataset: "other:make".into(),
                    ..b.clone()
                },
            ),
            (
                "dataset_args",
                JobSpec {
                    dataset_args: "{}".into(),
                    ..b.clone()
                },
            ),
            (
                "code_version",
                JobSpec {
                    code_version: "abc124".into(),
                    ..b.clone()
                },
            ),
            (
                "seed",
                JobSpec {
                    seed: 43,
                    ..b.clone()
                },
            ),
            (
                "length",
                JobSpec {
                    length: 1004,
                    ..b.clone()
                },
            ),
            (
                "global_batch",
                JobSpec {
                    global_batch: 33,
                    ..b.clone()
                },
            ),
            (
                "split_batches",
                JobSpec {
                    split_batches: 5,
                    ..b.clone()
                },
            ),
            (
                "drop_last",
                JobSpec {
                    drop_last: true,
                    ..b.clone()
                },
            ),
            (
                "shuffle",
                JobSpec {
                    shuffle: false,
                    shards: vec![],
                    ..b
                },
            ),
        ]
    }

    #[test]
    fn job_id_is_pinned() {
        // A regression guard: if this changes, the encoding changed and every
        // existing job would be orphaned. Bump JOB_FORMAT deliberately instead.
        assert_eq!(spec().job_id(), "ab44350f10556687c19416787bab197f");
        let id = spec().job_id();
        assert_eq!(id.len(), 32);
        assert!(id
            .bytes()
            .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
    }

    #[test]
    fn job_id_changes_with_every_field() {
        let base = spec().job_id();
        let mut ids = HashSet::from([base.clone()]);
        for (field, v) in variants() {
            assert!(ids.insert(v.job_id()), "{field} does not change the id");
        }
        // Length prefixes keep string boundaries apart.
        let a = JobSpec {
            dataset: "a:b".into(),
            dataset_args: "{}x".into(),
            ..spec()
        };
        let b = JobSpec {
            dataset: "a:b{".into(),
            dataset_args: "}x".into(),
            ..spec()
        };
        assert_ne!(a.job_id(), b.job_id());
        // Serde round trips keep the id.
        let back: JobSpec = serde_json::from_str(&serde_json::to_string(&spec()).unwrap()).unwrap();
        assert_eq!(back.job_id(), base);
    }

    #[test]
    fn differences_name_exactly_the_changed_fields() {
        assert!(spec().differences(&spec()).is_empty());
        for (field, v) in variants() {
            let diff = spec().differences(&v);
            assert_eq!(diff.len(), 1, "{diff:?}");
            assert!(diff[0].starts_with(&format!("{field}: ")), "{diff:?}");
        }
        let two = JobSpec {
            seed: 1,
            shuffle: false,
            shards: vec![],
            ..spec()
        };
        assert_eq!(
            spec().differences(&two),
            ["seed: 42 != 1", "shuffle: true != false"]
        );
        let ds = JobSpec {
            dataset: String::new(),
            ..spec()
        };
        assert_eq!(
            spec().differences(&ds),
            [r#"dataset: "my_data:make" != """#]
        );
    }

    #[test]
    fn example_seeds_do_not_collide() {
        let mut seen = HashSet::new();
        for epoch in 0..100 {
            for index in 0..1000 {
                assert!(
                    seen.insert(example_seed(9, epoch, index)),
                    "({epoch}, {index})"
                );
            }
        }
        assert_eq!(example_seed(9, 3, 4), example_seed(9, 3, 4));
        assert_ne!(example_seed(9, 3, 4), example_seed(10, 3, 4));
        for k in 0..1000u64 {
            let (s, e, i) = (mix(k + 1000), k % 7, mix(k + 5000));
            assert_ne!(example_seed(s, e, i), example_seed(s, i, e), "{k}");
            assert_ne!(example_seed(s, e, i), example_seed(e, s, i), "{k}");
        }
    }

    fn sharded(counts: Vec<u64>, shuffle: bool) -> JobSpec {
        JobSpec {
            dataset: "shards:make".into(),
            dataset_args: "{}".into(),
            code_version: "v1".into(),
            seed: 3,
            length: counts.iter().sum(),
            global_batch: 4,
            split_batches: 3,
            drop_last: false,
            shuffle,
            shards: counts,
        }
    }

    proptest! {
        /// Every record once per epoch, and each split reads every shard it
        /// touches as one contiguous run (sequential reads, no seeks).
        #[test]
        fn sharded_orders_cover_every_record_once_in_contiguous_runs_per_split(
            counts in proptest::collection::vec(0u64..40, 1..8),
            shuffle in any::<bool>(),
            epoch in 0u64..5,
        ) {
            prop_assume!(counts.iter().sum::<u64>() > 0);
            let spec = sharded(counts.clone(), shuffle);
            spec.validate().unwrap();
            let order = spec.order(epoch);
            let len = spec.length;
            let mut seen: Vec<u64> = (0..len).map(|p| order.index(p)).collect();
            seen.sort_unstable();
            prop_assert_eq!(seen, (0..len).collect::<Vec<_>>());
            let split_len = spec.global_batch * spec.split_batches;
            let mut start = 0;
            while start < len {
                let end = (start + split_len).min(len);
                let mut by_shard: std::collections::BTreeMap<u64, Vec<u64>> = Default::default();
                for p in start..end {
                    let at = order.shard_offset(p).unwrap();
                    prop_assert!(at.offset < counts[at.shard as usize]);
                    by_shard.entry(at.shard).or_default().push(at.offset);
                }
                for offsets in by_shard.values_mut() {
                    offsets.sort_unstable();
                    let first = offsets[0];
                    prop_assert_eq!(offsets.clone(), (first..first + offsets.len() as u64).collect::<Vec<_>>());
                }
                start = end;
            }
            if !shuffle {
                prop_assert!((0..len).all(|p| order.index(p) == p));
            }
        }
    }

    #[test]
    fn sharded_jobs_change_their_order_per_epoch_and_name_shard_differences() {
        let spec = sharded(vec![30, 0, 25, 40, 12], true);
        let a: Vec<u64> = (0..spec.length).map(|p| spec.order(0).index(p)).collect();
        let b: Vec<u64> = (0..spec.length).map(|p| spec.order(1).index(p)).collect();
        assert_ne!(a, b);
        let mut other = spec.clone();
        other.shards[2] = 26;
        other.length += 1;
        assert_ne!(spec.job_id(), other.job_id());
        let diff = spec.differences(&other);
        assert!(
            diff.iter()
                .any(|d| d.starts_with("shards:") && d.contains("shard 2")),
            "{diff:?}"
        );
        let mut bad = spec.clone();
        bad.length += 1;
        assert!(bad.validate().unwrap_err().to_string().contains("shards"));
        // A map-style job keeps the id it had before shards existed.
        let map = JobSpec {
            shards: vec![],
            ..spec
        };
        assert_eq!(
            map.job_id(),
            JobSpec {
                shards: vec![],
                ..map.clone()
            }
            .job_id()
        );
    }
}
