//! hindsight engine. No Python here; the binding lives in `hindsight-py`.
//!
//! - [`checkpoint`]: the crash-safe, deduplicating checkpoint store with a
//!   background writer (format, storage backends, replica, retention).
//! - [`runs`]: recorded runs and their logs (project home, log database,
//!   adaptive policy, replay plans, resume selection).
//! - Shared by both and by the services built on them: [`error`],
//!   [`durable`] writes, [`sync`] and [`staging`] memory.

pub mod checkpoint;
pub mod durable;
pub mod error;
pub mod forksafe;
pub mod runs;
pub mod settings;
pub mod staging;
pub mod sync;
pub mod units;

pub use checkpoint::compare::{check_state, Difference, StateCheck};
pub use checkpoint::device_fp::{device_fingerprint, DeviceFingerprint, DeviceFpSum};
pub use checkpoint::fingerprint::{fingerprint, fingerprint_many, Fingerprint};
pub use checkpoint::format::{Array, ArrayLib, Blob, ChunkId, Codec, Manifest, Node};
pub use checkpoint::location::Location;
pub use checkpoint::naming::{CheckpointId, Kind as CheckpointKind};
#[cfg(feature = "s3")]
pub use checkpoint::object::ObjectStorage;
pub use checkpoint::replica::{MetricSource, ReadTree, Replica};
pub use checkpoint::storage::{LocalStorage, Storage};
pub use checkpoint::store::{GcReport, Store, StoreOptions, Usage};
pub use checkpoint::upload::{copy_checkpoint, CopyStats, Uploader};
pub use checkpoint::writer::{
    Lent, ReuseCheck, ReuseLock, SaveBuilder, SaveHandle, SaveStats, StagedBlob, Writer,
    WriterOptions,
};
pub use error::{Error, ErrorKind, Result};
pub use runs::adaptive::AdaptivePolicy;
pub use runs::db::{
    Divergence, IterationRow, LogDb, LogRecord, LogRow, LogValue, NewRun, Phase, RunRow, RunStatus,
};
pub use runs::replay::schedule::{
    partition, plan_partial, plan_segments, PartialPlan, PartialStep, Segment,
};
