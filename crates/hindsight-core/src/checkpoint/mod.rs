//! Checkpoints: the on-disk format and tree visitor, content fingerprints
//! (host and device),
//! live-state comparison,
//! names, storage backends, the store (read, gc, verify), the background
//! writer, the local-first replica, retention and upload.

pub mod cancel;
pub mod compare;
pub mod device_fp;
pub mod export;
pub mod fingerprint;
pub mod format;
pub mod layout;
pub mod location;
pub mod naming;
#[cfg(feature = "s3")]
pub mod object;
pub mod parts;
pub mod replica;
pub mod retention;
pub mod save;
pub mod shard;
pub mod storage;
pub mod store;
pub mod upload;
pub mod walk;
pub mod writer;
#[cfg(feature = "s3")]
pub mod xrootd;
