//! Every `HINDSIGHT_*` environment variable, once: its name, its type, its
//! default and what it does. Core, the CLI and the Python package read them
//! through this table (the binding exposes it; `hindsight settings` prints
//! it), so a variable is spelled, parsed and documented in one place, and a
//! value that does not parse is an error naming the variable, never a
//! silent default.
//!
//! Range rules that belong to one component stay with it (the adaptive
//! policy's ε in `runs::schedule`); this module owns the names, the kinds
//! and the parsing.

use std::ffi::OsString;

use crate::error::{Error, Result};

/// What a variable holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Kind {
    /// A filesystem path.
    Path,
    /// A store location: a directory or `s3://bucket/prefix`.
    Location,
    /// `1`/`0` (also `true`/`false`, `yes`/`no`, `on`/`off`).
    Flag,
    /// A whole number.
    Int,
    /// A finite number.
    Float,
    /// A byte count (`500MB`, `16GiB`; [`crate::units::parse_size`]).
    Bytes,
    /// Free text.
    Text,
}

impl Kind {
    /// Its name, for a person (and the Python binding).
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Path => "path",
            Kind::Location => "location",
            Kind::Flag => "flag",
            Kind::Int => "int",
            Kind::Float => "float",
            Kind::Bytes => "bytes",
            Kind::Text => "text",
        }
    }
}

/// A parsed value.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Value {
    /// [`Kind::Path`], [`Kind::Location`] and [`Kind::Text`].
    Text(String),
    /// [`Kind::Flag`].
    Flag(bool),
    /// [`Kind::Int`].
    Int(i64),
    /// [`Kind::Bytes`].
    Bytes(u64),
    /// [`Kind::Float`].
    Float(f64),
}

/// One environment variable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Setting {
    /// `HINDSIGHT_...`.
    pub name: &'static str,
    /// What it holds.
    pub kind: Kind,
    /// What applies when it is unset, for a person.
    pub default: &'static str,
    /// What it does.
    pub doc: &'static str,
    /// Set by hindsight for the processes it starts, not by users.
    pub internal: bool,
}

const fn user(name: &'static str, kind: Kind, default: &'static str, doc: &'static str) -> Setting {
    Setting {
        name,
        kind,
        default,
        doc,
        internal: false,
    }
}

const fn internal(name: &'static str, kind: Kind, doc: &'static str) -> Setting {
    Setting {
        name,
        kind,
        default: "-",
        doc,
        internal: true,
    }
}

/// The project home: run database and default store.
pub const HOME: Setting = user(
    "HINDSIGHT_HOME",
    Kind::Path,
    ".hindsight at the git root, else beside the script",
    "the project home directory (logs.db, the default store)",
);
/// The checkpoint store.
pub const STORE: Setting = user(
    "HINDSIGHT_STORE",
    Kind::Location,
    "<home>/store",
    "where checkpoints go: a directory, s3://bucket/prefix, az://container/prefix or root://host//path",
);
/// A local directory saves go to first, uploaded to the store after.
pub const LOCAL_FIRST: Setting = user(
    "HINDSIGHT_LOCAL_FIRST",
    Kind::Path,
    "off",
    "save to this local directory first and upload to the store in the background",
);
/// A fixed checkpoint period.
pub const CHECKPOINT_EVERY: Setting = user(
    "HINDSIGHT_CHECKPOINT_EVERY",
    Kind::Int,
    "adaptive",
    "checkpoint every N iterations of the outer loop instead of the adaptive policy",
);
/// The adaptive policy's overhead bound.
pub const EPSILON: Setting = user(
    "HINDSIGHT_EPSILON",
    Kind::Float,
    "1/15",
    "the most recording may add to training time (fraction), between 0 and 1",
);
/// How much of the store a run's checkpoints may keep.
pub const CHECKPOINT_BUDGET: Setting = user(
    "HINDSIGHT_CHECKPOINT_BUDGET",
    Kind::Bytes,
    "16GiB",
    "the most a recording's checkpoints keep in the store (e.g. 500MB, 16GiB): beyond it they are thinned \
     to a spread over the run, never below 8; a retention chosen (hs.checkpointing, a framework \
     callback's keep_* arguments) replaces it",
);
/// The period of safety checkpoints inside long iterations.
pub const SAFETY_MINUTES: Setting = user(
    "HINDSIGHT_SAFETY_MINUTES",
    Kind::Float,
    "60",
    "minutes after which a step boundary takes a safety checkpoint (a crash loses at most this much)",
);
/// Whether an interrupted run is resumed.
pub const RESUME: Setting = user(
    "HINDSIGHT_RESUME",
    Kind::Flag,
    "1",
    "0: start a new run instead of resuming the script's interrupted one",
);
/// A relaunch on another world size resumes by resharding.
pub const RESHARD: Setting = user(
    "HINDSIGHT_RESHARD",
    Kind::Flag,
    "0",
    "1: a relaunch on another number of ranks resumes from the newest checkpoint between iterations, \
     the model and optimizer resharded (not exact: new ranks' RNG streams and the data order are new)",
);
/// The run a relaunch resumes, by name.
pub const RUN_NAME: Setting = user(
    "HINDSIGHT_RUN_NAME",
    Kind::Text,
    "the script and its arguments",
    "the name that identifies a run across relaunches (resumes the run of that name)",
);
/// The exit code after a preemption checkpoint.
pub const EXIT_CODE: Setting = user(
    "HINDSIGHT_EXIT_CODE",
    Kind::Int,
    "85 (HTCondor's CheckpointExitCode when set)",
    "the exit code after a signal's checkpoint, which asks the batch system to run the job again",
);
/// Slurm requeue after a preemption checkpoint.
pub const SLURM_REQUEUE: Setting = user(
    "HINDSIGHT_SLURM_REQUEUE",
    Kind::Flag,
    "0",
    "1: after a signal's checkpoint, `scontrol requeue` the Slurm job",
);
/// Ctrl-C as a preemption signal.
pub const CATCH_SIGINT: Setting = user(
    "HINDSIGHT_CATCH_SIGINT",
    Kind::Flag,
    "0",
    "1: SIGINT (Ctrl-C) checkpoints and exits as SIGTERM does",
);
/// One line per checkpoint decision of a recording.
pub const VERBOSE: Setting = user(
    "HINDSIGHT_VERBOSE",
    Kind::Flag,
    "0",
    "1: a recording says each checkpoint decision (saved or not, and why)",
);
/// No start and end lines.
pub const QUIET: Setting = user(
    "HINDSIGHT_QUIET",
    Kind::Flag,
    "0",
    "1: a recording prints no line when it starts and ends (errors and notes still)",
);
/// Replay workers forked from a zygote.
pub const REPLAY_FORK: Setting = user(
    "HINDSIGHT_REPLAY_FORK",
    Kind::Flag,
    "1",
    "0: each replay worker is a fresh interpreter instead of a fork of one that imported torch",
);
/// Which Lightning package the integration uses.
pub const LIGHTNING: Setting = user(
    "HINDSIGHT_LIGHTNING",
    Kind::Text,
    "the one the script imported",
    "`lightning` or `pytorch_lightning`: the package HindsightCheckpoint/HindsightLogger use",
);
/// A replay worker's plan.
pub const REPLAY: Setting = internal(
    "HINDSIGHT_REPLAY",
    Kind::Path,
    "a replay worker's plan (JSON file): set, the script replays instead of recording",
);
/// `hindsight record --explain`.
pub const EXPLAIN: Setting = internal(
    "HINDSIGHT_EXPLAIN",
    Kind::Flag,
    "`hindsight record --explain`: say what would be checkpointed, then stop",
);
/// The supervisor's heartbeat pipe.
pub const HEARTBEAT_FD: Setting = internal(
    "HINDSIGHT_HEARTBEAT_FD",
    Kind::Int,
    "the descriptor `hindsight run` reads heartbeats from (hang detection)",
);
/// The process holding the pipes a launcher between (torchrun) closed.
pub const PIPES_AT: Setting = internal(
    "HINDSIGHT_PIPES_AT",
    Kind::Int,
    "the pid of `python -m hindsight.torchrun`: a rank reopens the heartbeat and progress pipes it holds",
);
/// How many times `hindsight run` restarted the command.
pub const RESTART: Setting = internal(
    "HINDSIGHT_RESTART",
    Kind::Int,
    "how many times `hindsight run` has restarted the command",
);
/// The recording's working directory, for a replay worker.
pub const RECORDED_CWD: Setting = internal(
    "HINDSIGHT_RECORDED_CWD",
    Kind::Path,
    "the recording's working directory, mirrored for a replay worker",
);
/// Other replay workers may run at the same time.
pub const REPLAY_CONCURRENT: Setting = internal(
    "HINDSIGHT_REPLAY_CONCURRENT",
    Kind::Flag,
    "1 when other workers of the same replay may run at the same time",
);

/// The input service's token (`hindsight_data::auth`).
pub const DATA_TOKEN: Setting = user(
    "HINDSIGHT_DATA_TOKEN",
    Kind::Text,
    "the dispatcher's token file",
    "the input service's token: every call to a dispatcher or worker carries it",
);
/// A file holding the input service's token.
pub const DATA_TOKEN_FILE: Setting = user(
    "HINDSIGHT_DATA_TOKEN_FILE",
    Kind::Path,
    "none",
    "a file holding the input service's token (a dispatcher keeps it in <journal>/token)",
);
/// The authority that signed the input service's certificates (PEM): TLS on.
pub const DATA_TLS_CA: Setting = user(
    "HINDSIGHT_DATA_TLS_CA",
    Kind::Path,
    "none: plain text",
    "the authority (PEM) that signed the input service's certificates: every process verifies its peers against it and connects over TLS",
);
/// A dispatcher's or worker's certificate (PEM).
pub const DATA_TLS_CERT: Setting = user(
    "HINDSIGHT_DATA_TLS_CERT",
    Kind::Path,
    "none",
    "a dispatcher's or worker's certificate (PEM), for the name or address others dial; with HINDSIGHT_DATA_TLS_KEY",
);
/// The key of [`DATA_TLS_CERT`] (PEM).
pub const DATA_TLS_KEY: Setting = user(
    "HINDSIGHT_DATA_TLS_KEY",
    Kind::Path,
    "none",
    "the private key (PEM) of HINDSIGHT_DATA_TLS_CERT",
);

/// Every variable, users' first.
pub const ALL: &[Setting] = &[
    HOME,
    STORE,
    LOCAL_FIRST,
    CHECKPOINT_EVERY,
    EPSILON,
    CHECKPOINT_BUDGET,
    SAFETY_MINUTES,
    RESUME,
    RESHARD,
    RUN_NAME,
    EXIT_CODE,
    SLURM_REQUEUE,
    CATCH_SIGINT,
    VERBOSE,
    QUIET,
    DATA_TOKEN,
    DATA_TOKEN_FILE,
    DATA_TLS_CA,
    DATA_TLS_CERT,
    DATA_TLS_KEY,
    REPLAY_FORK,
    LIGHTNING,
    REPLAY,
    EXPLAIN,
    HEARTBEAT_FD,
    PIPES_AT,
    RESTART,
    RECORDED_CWD,
    REPLAY_CONCURRENT,
];

/// The variable called `name`.
pub fn find(name: &str) -> Option<&'static Setting> {
    ALL.iter().find(|s| s.name == name)
}

impl Setting {
    /// Its value in this process's environment, unparsed (`None`: unset).
    pub fn raw(&self) -> Option<OsString> {
        std::env::var_os(self.name)
    }

    /// Its value in this process's environment, parsed; `None` when unset
    /// or empty.
    pub fn get(&self) -> Result<Option<Value>> {
        self.parse(self.raw())
    }

    /// `raw` parsed as this variable's kind. An empty value is unset.
    pub fn parse(&self, raw: Option<OsString>) -> Result<Option<Value>> {
        let Some(raw) = raw else { return Ok(None) };
        let Some(text) = raw.to_str() else {
            return Err(self.bad(&raw.to_string_lossy(), "is not valid UTF-8"));
        };
        let t = text.trim();
        if t.is_empty() {
            return Ok(None);
        }
        let v = match self.kind {
            Kind::Path | Kind::Location | Kind::Text => Value::Text(text.to_owned()),
            Kind::Flag => match t.to_ascii_lowercase().as_str() {
                "1" | "true" | "yes" | "on" => Value::Flag(true),
                "0" | "false" | "no" | "off" => Value::Flag(false),
                _ => return Err(self.bad(t, "is not a flag: give 1 or 0")),
            },
            Kind::Int => Value::Int(
                t.parse()
                    .map_err(|_| self.bad(t, "is not a whole number"))?,
            ),
            Kind::Float => match t.parse::<f64>() {
                Ok(x) if x.is_finite() => Value::Float(x),
                _ => return Err(self.bad(t, "is not a finite number")),
            },
            Kind::Bytes => Value::Bytes(
                crate::units::parse_size(t)
                    .ok_or_else(|| self.bad(t, "is not a size: give e.g. 500MB or 16GiB"))?,
            ),
        };
        Ok(Some(v))
    }

    /// A flag's value, `default` when unset.
    pub fn flag(&self, default: bool) -> Result<bool> {
        Ok(match self.get()? {
            Some(Value::Flag(b)) => b,
            _ => default,
        })
    }

    /// An int's value (`None`: unset).
    pub fn int(&self) -> Result<Option<i64>> {
        Ok(match self.get()? {
            Some(Value::Int(i)) => Some(i),
            _ => None,
        })
    }

    /// A size's value in bytes (`None`: unset).
    pub fn bytes(&self) -> Result<Option<u64>> {
        Ok(match self.get()? {
            Some(Value::Bytes(b)) => Some(b),
            _ => None,
        })
    }

    /// A float's value (`None`: unset).
    pub fn float(&self) -> Result<Option<f64>> {
        Ok(match self.get()? {
            Some(Value::Float(x)) => Some(x),
            _ => None,
        })
    }

    fn bad(&self, value: &str, why: &str) -> Error {
        Error::invalid(format!("${}", self.name), format!("{value:?} {why}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn os(s: &str) -> Option<OsString> {
        Some(s.into())
    }

    #[test]
    fn each_variable_is_listed_once_and_named_hindsight() {
        let mut names: Vec<_> = ALL.iter().map(|s| s.name).collect();
        names.sort_unstable();
        let n = names.len();
        names.dedup();
        assert_eq!(names.len(), n, "a variable listed twice");
        assert!(ALL
            .iter()
            .all(|s| s.name.starts_with("HINDSIGHT_") && !s.doc.is_empty()));
        assert_eq!(find("HINDSIGHT_EPSILON"), Some(&EPSILON));
        assert_eq!(find(concat!("HINDSIGHT_", "NOPE")), None);
    }

    #[test]
    fn values_parse_by_kind_and_a_bad_one_names_the_variable() {
        assert_eq!(RESUME.parse(os(" 0 ")).unwrap(), Some(Value::Flag(false)));
        assert_eq!(RESUME.parse(os("TRUE")).unwrap(), Some(Value::Flag(true)));
        assert_eq!(RESUME.parse(os("")).unwrap(), None);
        assert_eq!(RESUME.parse(None).unwrap(), None);
        assert_eq!(EXIT_CODE.parse(os("42")).unwrap(), Some(Value::Int(42)));
        assert_eq!(EPSILON.parse(os("0.1")).unwrap(), Some(Value::Float(0.1)));
        assert_eq!(
            HOME.parse(os(" /a b ")).unwrap(),
            Some(Value::Text(" /a b ".into()))
        );
        for (s, v, why) in [
            (RESUME, "maybe", "is not a flag"),
            (EXIT_CODE, "8.5", "is not a whole number"),
            (SAFETY_MINUTES, "inf", "is not a finite number"),
            (SAFETY_MINUTES, "ten", "is not a finite number"),
        ] {
            let e = s.parse(os(v)).unwrap_err().to_string();
            assert!(
                e.contains(s.name) && e.contains(why) && e.contains(v),
                "{e}"
            );
        }
    }
}
