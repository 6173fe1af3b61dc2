//! The cancellation check long store operations poll (staging waits and
//! copies, reads, exports): its own module, so that the store, the writer
//! and the operations built on them share it without depending on each other.

/// A cancellation check: true once the operation should stop.
pub type Cancel<'a> = &'a (dyn Fn() -> bool + Sync);
