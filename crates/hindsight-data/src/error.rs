//! Errors of the input service: typed, each carrying what the user needs to
//! act (the address, the dataset, the differing field), never a bare string.

use crate::journal::JournalError;
use crate::order::OrderError;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error(transparent)]
    Order(#[from] OrderError),
    #[error(transparent)]
    Journal(#[from] JournalError),
    /// Nothing answers at an address (or it answered too late).
    #[error("input service: cannot reach the {role} at {addr}: {detail}")]
    Unreachable {
        role: &'static str,
        addr: String,
        detail: String,
    },
    /// An attach or request that does not match what the other side runs:
    /// another job under the same name, another protocol or code version.
    #[error("input service: {what} does not match: {detail}")]
    Mismatch { what: &'static str, detail: String },
    /// The user's dataset factory or pipeline raised; `detail` holds its
    /// traceback as the worker printed it.
    #[error("input service: dataset {dataset} failed in a worker:\n{detail}")]
    Pipeline { dataset: String, detail: String },
    /// A recomputed unit differs from the first computation of it.
    #[error(
        "input service: batch {batch} of epoch {epoch} was computed twice with different \
         content (digests {first} and {second}): the dataset pipeline is not deterministic \
         given (seed, epoch, index); draw randomness only from the generators the worker \
         seeds, or pass nondeterministic='warn'"
    )]
    NonDeterministic {
        epoch: u64,
        batch: u64,
        first: String,
        second: String,
    },
    /// No worker that serves the dataset stayed alive long enough.
    #[error("input service: no live worker serves dataset {dataset} (waited {waited_s:.1} s)")]
    NoWorkers { dataset: String, waited_s: f64 },
    /// A call the service made failed in a way no retry fixes.
    #[error("input service: {op} failed: {detail}")]
    Rpc { op: &'static str, detail: String },
    #[error("input service: {what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// The service token is missing, unreadable or malformed (never shown).
    #[error("input service: {0}")]
    Token(String),
    /// TLS was asked for but half given, or a certificate or key is unusable.
    #[error("input service: TLS: {0}")]
    Tls(String),
    /// The client was used after `close()` or from a forked child.
    #[error("input service: {0}")]
    Closed(String),
}

/// What kind of failure an [`Error`] is: the binding maps each kind to one
/// exception class with an exhaustive match, so a new kind does not compile
/// until it has one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidArgument,
    Corrupt,
    Unreachable,
    Mismatch,
    Pipeline,
    NonDeterministic,
    NoWorkers,
    Rpc,
    Io,
    Closed,
}

impl Error {
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Order(_) => ErrorKind::InvalidArgument,
            Error::Journal(JournalError::Io { .. }) => ErrorKind::Io,
            Error::Journal(JournalError::TooLarge { .. }) => ErrorKind::InvalidArgument,
            // Another dispatcher's, not damage: nothing is wrong with the file.
            Error::Journal(JournalError::Locked { .. }) => ErrorKind::Io,
            Error::Journal(_) => ErrorKind::Corrupt,
            Error::Unreachable { .. } => ErrorKind::Unreachable,
            Error::Mismatch { .. } => ErrorKind::Mismatch,
            Error::Pipeline { .. } => ErrorKind::Pipeline,
            Error::NonDeterministic { .. } => ErrorKind::NonDeterministic,
            Error::NoWorkers { .. } => ErrorKind::NoWorkers,
            Error::Rpc { .. } => ErrorKind::Rpc,
            Error::Io { .. } => ErrorKind::Io,
            Error::Token(_) | Error::Tls(_) => ErrorKind::InvalidArgument,
            Error::Closed(_) => ErrorKind::Closed,
        }
    }

    /// The address the error is about, if any.
    pub fn addr(&self) -> Option<&str> {
        match self {
            Error::Unreachable { addr, .. } => Some(addr),
            _ => None,
        }
    }

    /// The dataset ("module:factory") the error is about, if any.
    pub fn dataset(&self) -> Option<&str> {
        match self {
            Error::Pipeline { dataset, .. } | Error::NoWorkers { dataset, .. } => Some(dataset),
            _ => None,
        }
    }

    pub(crate) fn rpc(op: &'static str, status: &tonic::Status) -> Error {
        Error::Rpc {
            op,
            detail: format!("{:?}: {}", status.code(), status.message()),
        }
    }
}
