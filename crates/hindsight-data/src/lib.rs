//! hindsight input service (seed 002): every example exactly once per epoch,
//! in a reproducible order, across worker failures.
//!
//! - [`order`]: job identity, the stateless epoch permutation, batches,
//!   splits and rank slices, per-example random seeds.
//! - [`journal`]: the dispatcher's append-only, checksummed journal.

pub mod client;
pub mod dispatcher;
pub mod error;
pub mod journal;
pub mod order;
pub mod proto;
pub mod worker;

pub use error::{Error, Result};
