//! The generated protocol and its conversions to the core types.

#![allow(unreachable_pub, missing_docs, clippy::all)]

tonic::include_proto!("hindsight.data.v1");

/// Raised whenever the messages or their meaning change: both ends refuse
/// a peer that speaks another version.
pub const PROTOCOL: u32 = 1;

impl From<&crate::order::JobSpec> for JobSpec {
    fn from(s: &crate::order::JobSpec) -> Self {
        JobSpec {
            dataset: s.dataset.clone(),
            dataset_args: s.dataset_args.clone(),
            code_version: s.code_version.clone(),
            seed: s.seed,
            length: s.length,
            global_batch: s.global_batch,
            split_batches: s.split_batches,
            drop_last: s.drop_last,
            shuffle: s.shuffle,
            shards: s.shards.clone(),
        }
    }
}

impl From<&JobSpec> for crate::order::JobSpec {
    fn from(s: &JobSpec) -> Self {
        crate::order::JobSpec {
            dataset: s.dataset.clone(),
            dataset_args: s.dataset_args.clone(),
            code_version: s.code_version.clone(),
            seed: s.seed,
            length: s.length,
            global_batch: s.global_batch,
            split_batches: s.split_batches,
            drop_last: s.drop_last,
            shuffle: s.shuffle,
            shards: s.shards.clone(),
        }
    }
}

/// A split's identity as a map key.
pub(crate) type Key = (String, u64, u32, u64);

impl SplitKey {
    pub(crate) fn key(&self) -> Key {
        (self.job_id.clone(), self.epoch, self.rank, self.split)
    }
}

/// Refuse a peer that speaks another protocol version, saying what to do.
pub(crate) fn check_protocol(theirs: u32, peer: &str) -> Result<(), tonic::Status> {
    if theirs == PROTOCOL {
        return Ok(());
    }
    Err(tonic::Status::failed_precondition(format!(
        "protocol mismatch: the {peer} speaks input-service protocol {theirs}, this process \
         speaks {PROTOCOL}; run the same hindsight version everywhere"
    )))
}
