//! Worker checkpoints (seed 002): the read state of a split a worker is
//! producing (its shard positions, its readers' own state, and the records
//! read ahead for later units), saved into a hindsight store at unit
//! boundaries, so the next worker of a failed split restores it instead of
//! reading the split again.
//!
//! Whether that pays depends on the pipeline, as the seed found: a
//! checkpoint stalls the worker for as long as it takes to snapshot what
//! it holds, and saves only the reading a failure would redo. The policy
//! weighs the two as this worker measures them, and stops checkpointing
//! where recomputing is cheaper ("sometimes no checkpoint is better").

use std::time::Duration;

/// The store name of a checkpoint of `split` of `epoch`, taken before
/// global batch `batch` (the first unit it lets a worker produce).
pub fn checkpoint_name(job_id: &str, epoch: u64, split: u64, batch: u64) -> String {
    format!("{}{batch:012}", split_prefix(job_id, epoch, split))
}

/// The names of all checkpoints of one split start with this.
pub fn split_prefix(job_id: &str, epoch: u64, split: u64) -> String {
    let job: String = job_id.chars().take(16).collect();
    format!("data-{job}-e{epoch}-s{split}-b")
}

/// The checkpoint to restore for a worker that starts `split` at `batch`:
/// the latest one taken at or before it. Other names are ignored.
pub fn latest_checkpoint<'a>(
    names: impl IntoIterator<Item = &'a str>,
    job_id: &str,
    epoch: u64,
    split: u64,
    batch: u64,
) -> Option<(&'a str, u64)> {
    let prefix = split_prefix(job_id, epoch, split);
    names
        .into_iter()
        .filter_map(|n| {
            let b: u64 = n.strip_prefix(&prefix)?.parse().ok()?;
            (b <= batch).then_some((n, b))
        })
        .max_by_key(|&(_, b)| b)
}

/// Reading a split again costs less than this: never worth a checkpoint.
const MIN_REDO: Duration = Duration::from_millis(20);

/// What a worker has measured, and what it decides from it.
#[derive(Debug, Clone)]
pub struct CheckpointPolicy {
    /// The share of production time checkpoint stalls may take.
    pub max_overhead: f64,
    read_s: f64,
    records_read: u64,
    stall_s: f64,
    records_saved: u64,
    unit_s: f64,
    units: u64,
    never: bool,
}

/// Why the policy decided as it did (for the worker's log and the bench).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Decision {
    /// Take one now.
    Checkpoint,
    /// Not yet: the last one is too recent for the overhead budget, or a
    /// failure would redo too little reading to matter.
    Wait,
    /// Restoring would cost more than reading again: this worker stops
    /// checkpointing.
    Never,
}

impl CheckpointPolicy {
    pub fn new(max_overhead: f64) -> Self {
        CheckpointPolicy {
            max_overhead: max_overhead.clamp(0.0, 1.0),
            read_s: 0.0,
            records_read: 0,
            stall_s: 0.0,
            records_saved: 0,
            unit_s: 0.0,
            units: 0,
            never: max_overhead <= 0.0,
        }
    }

    /// `n` records read from the dataset in `secs`.
    pub fn observe_read(&mut self, n: u64, secs: f64) {
        self.records_read += n;
        self.read_s += secs.max(0.0);
    }

    /// One unit produced in `secs` (reading, transforms, encoding).
    pub fn observe_unit(&mut self, secs: f64) {
        self.units += 1;
        self.unit_s += secs.max(0.0);
    }

    /// A checkpoint of `records` records stalled the worker for `secs`.
    pub fn observe_checkpoint(&mut self, records: u64, secs: f64) {
        self.records_saved += records.max(1);
        self.stall_s += secs.max(0.0);
    }

    pub fn read_s_per_record(&self) -> Option<f64> {
        (self.records_read > 0).then(|| self.read_s / self.records_read as f64)
    }

    pub fn stall_s_per_record(&self) -> Option<f64> {
        (self.records_saved > 0).then(|| self.stall_s / self.records_saved as f64)
    }

    pub fn gave_up(&self) -> bool {
        self.never
    }

    /// At a unit boundary of a split that has read `read` records so far,
    /// holds `kept` of them for later units, and produced `since` units since
    /// its last checkpoint (or its start).
    pub fn decide(&mut self, read: u64, kept: u64, since: u64) -> Decision {
        if self.never {
            return Decision::Never;
        }
        let Some(r) = self.read_s_per_record() else {
            return Decision::Wait;
        };
        let redo = r * read as f64;
        if redo < MIN_REDO.as_secs_f64() {
            return Decision::Wait;
        }
        let Some(c) = self.stall_s_per_record() else {
            // No measurement of a checkpoint yet: the first one measures.
            return Decision::Checkpoint;
        };
        // A restore reads back what the checkpoint wrote: assume it costs
        // what writing stalled. Unless saving and restoring beat reading
        // again, a checkpoint cannot pay off even if a failure is certain.
        let restore = c * kept.max(1) as f64;
        if 2.0 * restore >= redo {
            self.never = true;
            return Decision::Never;
        }
        let unit = if self.units > 0 {
            self.unit_s / self.units as f64
        } else {
            return Decision::Wait;
        };
        // Keep the stalls within the overhead budget of production time.
        if restore <= self.max_overhead * unit * since as f64 {
            Decision::Checkpoint
        } else {
            Decision::Wait
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_latest_checkpoint_at_or_before_the_start_is_chosen() {
        let names: Vec<String> = [3u64, 7, 12]
            .iter()
            .map(|&b| checkpoint_name("abcdef0123456789ff", 2, 5, b))
            .chain([
                checkpoint_name("abcdef0123456789ff", 2, 6, 9),
                checkpoint_name("abcdef0123456789ff", 1, 5, 9),
                "data-other".to_string(),
            ])
            .collect();
        let pick = |b| {
            latest_checkpoint(
                names.iter().map(|s| s.as_str()),
                "abcdef0123456789ff",
                2,
                5,
                b,
            )
        };
        assert_eq!(pick(9).map(|p| p.1), Some(7));
        assert_eq!(pick(12).map(|p| p.1), Some(12));
        assert_eq!(pick(2), None);
        for n in &names[..3] {
            hindsight_core::checkpoint::format::validate_name(n).unwrap();
        }
    }

    #[test]
    fn cheap_reading_is_never_checkpointed_and_expensive_reading_is_within_budget() {
        // Reading costs 10 us a record, a checkpoint 20 us a record kept.
        let mut cheap = CheckpointPolicy::new(0.05);
        cheap.observe_read(10_000, 0.1);
        cheap.observe_unit(0.01);
        assert_eq!(cheap.decide(10_000, 9_000, 1), Decision::Checkpoint);
        cheap.observe_checkpoint(9_000, 0.18);
        assert_eq!(cheap.decide(10_000, 8_000, 1), Decision::Never);
        assert!(cheap.gave_up());

        // Reading costs 2 ms a record (decompression, packing), a
        // checkpoint 20 us a record: worth it, spaced by the budget.
        let mut dear = CheckpointPolicy::new(0.05);
        dear.observe_read(1_000, 2.0);
        for _ in 0..10 {
            dear.observe_unit(0.2);
        }
        assert_eq!(dear.decide(1_000, 900, 1), Decision::Checkpoint);
        dear.observe_checkpoint(900, 0.018);
        // Restore ~18 ms; the budget is 5% of 200 ms a unit = 10 ms per unit.
        assert_eq!(dear.decide(1_000, 800, 1), Decision::Wait);
        assert_eq!(dear.decide(1_000, 800, 2), Decision::Checkpoint);
        // A split that read little is not worth one.
        assert_eq!(dear.decide(5, 5, 10), Decision::Wait);
        assert_eq!(
            CheckpointPolicy::new(0.0).decide(1_000, 1, 9),
            Decision::Never
        );
    }
}
