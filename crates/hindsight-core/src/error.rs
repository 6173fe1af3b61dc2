//! One error type for the whole engine. Every variant names what it is about
//! (a path, a checkpoint, a key path) so a user can act on the message alone.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A store, checkpoint or key path that does not exist.
    #[error("{what} not found: {name} ({location})")]
    NotFound {
        what: &'static str,
        name: String,
        location: String,
    },

    /// Names asked of `runs` that none of them logged; `logged` is what
    /// they did log, so a typo can be seen at once.
    #[error("{} never logged {} ({})", runs_phrase(runs), quoted(names), logged_phrase(runs.len(), logged))]
    NotLogged {
        runs: Vec<String>,
        names: Vec<String>,
        logged: Vec<String>,
    },

    /// Bytes on storage that fail their checksum or do not parse.
    #[error("corrupt {}{}: {detail} (file {})",
        checkpoint.as_deref().map(|c| format!("checkpoint '{c}'")).unwrap_or_else(|| "data".into()),
        key_path.as_deref().map(|k| format!(" at key '{k}'")).unwrap_or_default(),
        path.display())]
    Corrupt {
        path: PathBuf,
        checkpoint: Option<String>,
        key_path: Option<String>,
        detail: String,
    },

    /// A value the format cannot hold without pickling.
    #[error("unsupported type {type_name} at key '{key_path}': {hint}")]
    UnsupportedType {
        key_path: String,
        type_name: String,
        hint: String,
    },

    /// A bad name, option or argument supplied by the caller.
    #[error("invalid {arg}: {detail}")]
    InvalidArgument { arg: String, detail: String },

    /// The device or quota is full; nothing half-written became visible.
    #[error("storage full while writing {}: {source}", path.display())]
    StorageFull { path: PathBuf, source: io::Error },

    #[error("I/O error on {}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },

    /// A background save failed; `source` is the original error.
    #[error("background save of checkpoint '{checkpoint}' failed: {source}")]
    Background {
        checkpoint: String,
        source: Arc<Error>,
    },

    /// The store was opened in another process (e.g. before a fork).
    #[error("store {} belongs to process {owner}; open a new Store in this process (pid {current})", path.display())]
    WrongProcess {
        path: PathBuf,
        owner: u32,
        current: u32,
    },

    /// Storage refused access: missing permission or credentials.
    #[error("access denied to {}: {source}", path.display())]
    PermissionDenied { path: PathBuf, source: io::Error },

    /// A conditional write lost a race: another process changed the object first.
    #[error("{} was changed by another process: {source}", path.display())]
    Precondition { path: PathBuf, source: io::Error },

    /// The lease that protected a save or a gc on object storage went stale
    /// or was taken over; nothing was committed under it.
    #[error("lease {} lost: {detail}", path.display())]
    LeaseLost { path: PathBuf, detail: String },

    /// The run/log database (SQLite) failed or is of an unknown schema
    /// version; `path` is the database file.
    #[error("log database {}: {detail}", path.display())]
    Database {
        path: PathBuf,
        detail: String,
        #[source]
        source: Option<rusqlite::Error>,
    },

    /// A broken invariant inside hindsight: a bug, reported instead of
    /// being papered over with a default.
    #[error("internal error: {detail} (a bug in hindsight; please report it)")]
    Internal { detail: String },

    /// The caller asked to stop (Ctrl-C) while `what` ran.
    #[error("{what} interrupted")]
    Interrupted { what: String },

    /// The store (or its writer) was closed before or during `what`.
    #[error("{location} is closed ({what})")]
    Closed { location: String, what: String },

    /// A save that never committed: an earlier step of it failed or was
    /// interrupted, and nothing of it became visible.
    #[error("save of checkpoint '{checkpoint}' was abandoned before it committed")]
    Abandoned { checkpoint: String },

    /// Bytes lent to a save never became final: the device copy that was to
    /// fill them failed (e.g. a CUDA error). Nothing of the save became visible.
    #[error("device copy for checkpoint '{checkpoint}' failed: {detail}")]
    Device { checkpoint: String, detail: String },

    /// A resume or replay of `run` that cannot be made exact (the script or
    /// its arguments no longer match what was recorded): it stops instead.
    #[error("{what} of run {run}: {detail}")]
    Replay {
        what: String,
        run: String,
        detail: String,
    },

    /// What a resume or replay of `run` computed differs from the recording
    /// at `at`: every value after it would be another run's.
    #[error("{what} of run {run} diverged from the recording: {detail}")]
    Diverged {
        what: String,
        run: String,
        at: String,
        detail: String,
    },
}

fn runs_phrase(runs: &[String]) -> String {
    match runs {
        [one] => format!("run {one}"),
        many => format!("runs {}", many.join(", ")),
    }
}

fn quoted(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("'{n}'"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn logged_phrase(n_runs: usize, logged: &[String]) -> String {
    let who = if n_runs == 1 { "it" } else { "they" };
    if logged.is_empty() {
        format!("{who} logged nothing")
    } else {
        format!("{who} logged: {}", logged.join(", "))
    }
}

/// What kind of error, for front ends that map kinds to their own types
/// (exception classes, exit codes). Deliberately exhaustive: a new kind must
/// be mapped by every front end before it compiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    NotFound,
    Corrupt,
    UnsupportedType,
    InvalidArgument,
    StorageFull,
    Io,
    PermissionDenied,
    Precondition,
    LeaseLost,
    WrongProcess,
    Database,
    Internal,
    Interrupted,
    Closed,
    Abandoned,
    Device,
    Replay,
    Diverged,
}

impl Error {
    /// Classify an I/O error: a full disk or quota gets its own variant.
    pub fn io(path: impl Into<PathBuf>, source: io::Error) -> Self {
        let path = path.into();
        match source.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => Error::StorageFull { path, source },
            Some(libc::EACCES) | Some(libc::EPERM) => Error::PermissionDenied { path, source },
            _ => Error::Io { path, source },
        }
    }

    pub fn corrupt(path: impl Into<PathBuf>, detail: impl Into<String>) -> Self {
        Error::Corrupt {
            path: path.into(),
            checkpoint: None,
            key_path: None,
            detail: detail.into(),
        }
    }

    pub fn invalid(arg: impl Into<String>, detail: impl Into<String>) -> Self {
        Error::InvalidArgument {
            arg: arg.into(),
            detail: detail.into(),
        }
    }

    /// Attach the checkpoint and key path to a corruption error found while reading one blob.
    pub fn in_checkpoint(self, checkpoint: &str, key: &str) -> Self {
        match self {
            Error::Corrupt {
                path,
                checkpoint: None,
                key_path: None,
                detail,
            } => Error::Corrupt {
                path,
                checkpoint: Some(checkpoint.to_string()),
                key_path: (!key.is_empty()).then(|| key.to_string()),
                detail,
            },
            other => other,
        }
    }

    /// The kind of the error a background failure started from.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::NotFound { .. } | Error::NotLogged { .. } => ErrorKind::NotFound,
            Error::Corrupt { .. } => ErrorKind::Corrupt,
            Error::UnsupportedType { .. } => ErrorKind::UnsupportedType,
            Error::InvalidArgument { .. } => ErrorKind::InvalidArgument,
            Error::StorageFull { .. } => ErrorKind::StorageFull,
            Error::Io { .. } => ErrorKind::Io,
            Error::Background { source, .. } => source.kind(),
            Error::WrongProcess { .. } => ErrorKind::WrongProcess,
            Error::PermissionDenied { .. } => ErrorKind::PermissionDenied,
            Error::Precondition { .. } => ErrorKind::Precondition,
            Error::LeaseLost { .. } => ErrorKind::LeaseLost,
            Error::Database { .. } => ErrorKind::Database,
            Error::Internal { .. } => ErrorKind::Internal,
            Error::Interrupted { .. } => ErrorKind::Interrupted,
            Error::Closed { .. } => ErrorKind::Closed,
            Error::Abandoned { .. } => ErrorKind::Abandoned,
            Error::Device { .. } => ErrorKind::Device,
            Error::Replay { .. } => ErrorKind::Replay,
            Error::Diverged { .. } => ErrorKind::Diverged,
        }
    }

    /// The file or object the error is about, if any.
    pub fn path(&self) -> Option<&std::path::Path> {
        match self.root() {
            Error::Corrupt { path, .. }
            | Error::StorageFull { path, .. }
            | Error::Io { path, .. }
            | Error::WrongProcess { path, .. }
            | Error::PermissionDenied { path, .. }
            | Error::Precondition { path, .. }
            | Error::LeaseLost { path, .. }
            | Error::Database { path, .. } => Some(path),
            _ => None,
        }
    }

    /// The checkpoint the error is about, if any.
    pub fn checkpoint(&self) -> Option<&str> {
        match self {
            Error::Corrupt { checkpoint, .. } => checkpoint.as_deref(),
            Error::Background { checkpoint, source } => {
                source.checkpoint().or(Some(checkpoint.as_str()))
            }
            Error::Abandoned { checkpoint } | Error::Device { checkpoint, .. } => Some(checkpoint),
            _ => None,
        }
    }

    /// The key path inside a checkpoint the error is about, if any.
    pub fn key_path(&self) -> Option<&str> {
        match self.root() {
            Error::Corrupt { key_path, .. } => key_path.as_deref(),
            Error::UnsupportedType { key_path, .. } => Some(key_path),
            _ => None,
        }
    }

    /// The argument an `InvalidArgument` names.
    pub fn arg(&self) -> Option<&str> {
        match self.root() {
            Error::InvalidArgument { arg, .. } => Some(arg),
            _ => None,
        }
    }

    /// The run a resume or replay error is about, if any.
    pub fn run(&self) -> Option<&str> {
        match self.root() {
            Error::Replay { run, .. } | Error::Diverged { run, .. } => Some(run),
            _ => None,
        }
    }

    pub fn internal(detail: impl Into<String>) -> Self {
        Error::Internal {
            detail: detail.into(),
        }
    }

    pub fn interrupted(what: impl Into<String>) -> Self {
        Error::Interrupted { what: what.into() }
    }

    /// The error a background failure started from (unwraps `Background`).
    pub fn root(&self) -> &Error {
        match self {
            Error::Background { source, .. } => source.root(),
            e => e,
        }
    }
}
