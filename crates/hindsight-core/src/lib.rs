//! hindsight engine: a crash-safe, deduplicating checkpoint store with a
//! background writer. No Python here; the binding lives in `hindsight-py`.

pub mod dates;
pub mod durable;
pub mod error;
pub mod fingerprint;
pub mod format;
pub mod json;
pub mod logdb;
pub mod mem;
pub mod naming;
pub mod plan;
pub mod project;
pub mod replay;
pub mod replica;
pub mod resume;
pub mod retention;
#[cfg(feature = "s3")]
pub mod s3;
pub mod storage;
pub mod store;
pub mod sync;
pub mod upload;
pub mod writer;

pub use error::{Error, ErrorKind, Result};
pub use fingerprint::{fingerprint, fingerprint_many, Fingerprint};
pub use format::{Array, ArrayLib, Blob, ChunkId, Codec, Manifest, Node};
pub use logdb::{
    Divergence, IterationRow, LogDb, LogRecord, LogRow, NewRun, Phase, RunRow, RunStatus,
};
pub use naming::{CheckpointId, Kind as CheckpointKind};
pub use plan::{
    partition, plan_partial, plan_segments, AdaptivePolicy, PartialPlan, PartialStep, Segment,
};
pub use replica::{MetricSource, ReadTree, Replica};
#[cfg(feature = "s3")]
pub use s3::S3Storage;
pub use storage::{LocalStorage, Storage};
pub use store::{GcReport, Store, StoreOptions, Usage};
pub use upload::{copy_checkpoint, CopyStats, Uploader};
pub use writer::{SaveBuilder, SaveHandle, SaveStats, StagedBlob, Writer, WriterOptions};
