//! The run/log database of hindsight logging: which training runs were
//! recorded (script, source snapshot, arguments, status), what they logged
//! (per loop context, in the record and the replay phase), how long each
//! loop iteration took and which checkpoint it left behind.
//!
//! One SQLite file in WAL mode with a 10 s busy timeout, so several
//! processes (a training run, parallel replay workers, a CLI query) can
//! read and write it at once. Every write is one `BEGIN IMMEDIATE`
//! transaction (taking the write lock up front, so the busy timeout, not an
//! immediate `SQLITE_BUSY`, arbitrates between writers). The schema version
//! lives in `PRAGMA user_version`; a newer version than this build knows is
//! refused.
//!
//! Values are JSON text. Python's `json.dumps` may write `NaN`, `Infinity`
//! and `-Infinity`; they are accepted wherever a JSON value is.

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::sync::OnceLock;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rusqlite::{
    params, Connection, ErrorCode, OptionalExtension, Row, Transaction, TransactionBehavior,
};

use crate::dates;
pub use crate::dates::now_ms;
use crate::error::{Error, Result};
use crate::json::{self, check_json};

/// Schema version this build writes (`PRAGMA user_version`).
pub const SCHEMA_VERSION: i64 = 2;

/// How long a writer waits for another process's transaction.
pub const BUSY_TIMEOUT: Duration = Duration::from_secs(10);

const SCHEMA_V1: &str = r#"
CREATE TABLE IF NOT EXISTS runs (
    id           TEXT PRIMARY KEY,
    script       TEXT NOT NULL,
    script_abs   TEXT NOT NULL,
    project_root TEXT NOT NULL,
    source_hash  TEXT NOT NULL,
    git_commit   TEXT,
    git_dirty    INTEGER,
    args         TEXT NOT NULL,
    status       TEXT NOT NULL CHECK (status IN ('running', 'completed', 'failed', 'interrupted')),
    started_ms   INTEGER NOT NULL,
    ended_ms     INTEGER,
    host         TEXT NOT NULL,
    versions     TEXT NOT NULL,
    pid          INTEGER NOT NULL,
    resume_key   TEXT
);
CREATE INDEX IF NOT EXISTS runs_by_start ON runs (started_ms);
CREATE INDEX IF NOT EXISTS runs_by_script ON runs (script_abs, started_ms);
CREATE INDEX IF NOT EXISTS runs_by_resume_key ON runs (resume_key, started_ms)
    WHERE resume_key IS NOT NULL;

CREATE TABLE IF NOT EXISTS sources (
    hash  TEXT PRIMARY KEY,
    files TEXT NOT NULL
);

CREATE TABLE IF NOT EXISTS logs (
    run_id     TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    name       TEXT NOT NULL,
    ctx        TEXT NOT NULL,
    value      TEXT NOT NULL,
    phase      TEXT NOT NULL CHECK (phase IN ('record', 'replay')),
    seq        INTEGER NOT NULL,
    created_ms INTEGER NOT NULL,
    UNIQUE (run_id, name, ctx, phase)
);
CREATE INDEX IF NOT EXISTS logs_by_seq ON logs (run_id, seq);

CREATE TABLE IF NOT EXISTS iterations (
    run_id              TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    loop_name           TEXT NOT NULL,
    idx                 INTEGER NOT NULL,
    seconds             REAL NOT NULL,
    checkpoint          TEXT,
    materialize_seconds REAL,
    restore_seconds     REAL,
    PRIMARY KEY (run_id, loop_name, idx)
);
"#;

/// Version 2: the checkpoint store a run writes to (a directory or
/// `s3://bucket/prefix`), so replay and resume read the same one.
const SCHEMA_V2: &str = "ALTER TABLE runs ADD COLUMN store TEXT;";

const RUN_COLUMNS: &str =
    "id, script, script_abs, project_root, source_hash, git_commit, git_dirty, \
     args, status, started_ms, ended_ms, host, versions, pid, resume_key, store";

/// State of a recorded run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RunStatus {
    Running,
    Completed,
    Failed,
    Interrupted,
}

impl RunStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Running => "running",
            RunStatus::Completed => "completed",
            RunStatus::Failed => "failed",
            RunStatus::Interrupted => "interrupted",
        }
    }
}

impl fmt::Display for RunStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for RunStatus {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "running" => Ok(RunStatus::Running),
            "completed" => Ok(RunStatus::Completed),
            "failed" => Ok(RunStatus::Failed),
            "interrupted" => Ok(RunStatus::Interrupted),
            _ => Err(Error::invalid(
                "run status",
                format!("'{s}' is not one of running, completed, failed, interrupted"),
            )),
        }
    }
}

/// Which phase wrote a log row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    Record,
    Replay,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Record => "record",
            Phase::Replay => "replay",
        }
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Phase {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "record" => Ok(Phase::Record),
            "replay" => Ok(Phase::Replay),
            _ => Err(Error::invalid(
                "log phase",
                format!("'{s}' is not one of record, replay"),
            )),
        }
    }
}

/// A run about to start; see [`LogDb::create_run`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct NewRun {
    /// Script path as the user gave it.
    pub script: String,
    pub script_abs: String,
    pub project_root: String,
    /// Content address of the source snapshot ([`LogDb::put_source`]).
    pub source_hash: String,
    pub git_commit: Option<String>,
    pub git_dirty: Option<bool>,
    /// JSON object text of the run's arguments; empty means `{}`.
    pub args_json: String,
    /// Start time (ms since the Unix epoch); `None`: now.
    pub started_ms: Option<u64>,
    pub host: String,
    /// JSON text (library versions, ...); empty means `{}`.
    pub versions_json: String,
    pub pid: u32,
    /// Key matching an interrupted run to resume ([`LogDb::find_resumable`]).
    pub resume_key: Option<String>,
}

/// A stored run.
#[derive(Debug, Clone, PartialEq)]
pub struct RunRow {
    pub id: String,
    pub script: String,
    pub script_abs: String,
    pub project_root: String,
    pub source_hash: String,
    pub git_commit: Option<String>,
    pub git_dirty: Option<bool>,
    pub args_json: String,
    pub status: RunStatus,
    pub started_ms: u64,
    pub ended_ms: Option<u64>,
    pub host: String,
    pub versions_json: String,
    pub pid: u32,
    pub resume_key: Option<String>,
    /// Where the run's checkpoints are (`None`: the project's default store).
    pub store: Option<String>,
}

/// One value to log: `name` at loop context `ctx` (outermost loop first,
/// e.g. `[("epoch", 3), ("step", 17)]`; empty at top level).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRow {
    pub name: String,
    pub ctx: Vec<(String, i64)>,
    pub value_json: String,
}

/// A stored log value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRecord {
    pub name: String,
    pub ctx: Vec<(String, i64)>,
    /// The context as stored: canonical JSON, e.g. `{"epoch":3,"step":17}`.
    pub ctx_json: String,
    pub value_json: String,
    pub phase: Phase,
    /// Position in the run's write order (both phases share one sequence).
    pub seq: i64,
    pub created_ms: u64,
}

/// Timing (and checkpoint) of one loop iteration.
#[derive(Debug, Clone, PartialEq)]
pub struct IterationRow {
    pub loop_name: String,
    pub idx: u64,
    /// Compute seconds of the iteration.
    pub seconds: f64,
    /// Name of the checkpoint saved at its end, if any.
    pub checkpoint: Option<String>,
    pub materialize_seconds: Option<f64>,
    pub restore_seconds: Option<f64>,
}

/// A value logged in both phases at the same context that differs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Divergence {
    pub name: String,
    pub ctx: Vec<(String, i64)>,
    pub ctx_json: String,
    pub record_value: String,
    pub replay_value: String,
    /// `seq` of the record-phase row (divergences come in this order).
    pub record_seq: i64,
}

/// The run/log database. `Send` but not `Sync` (one SQLite connection):
/// share it behind a `Mutex`, or open one per thread/process.
#[derive(Debug)]
pub struct LogDb {
    conn: Connection,
    path: PathBuf,
}

fn db_err(path: &Path, e: rusqlite::Error) -> Error {
    if let rusqlite::Error::SqliteFailure(f, _) = &e {
        match f.code {
            ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase => {
                return Error::corrupt(path, format!("not a usable log database: {e}"))
            }
            ErrorCode::DiskFull => {
                return Error::StorageFull {
                    path: path.to_path_buf(),
                    source: io::Error::other(e.to_string()),
                }
            }
            _ => {}
        }
    }
    Error::Database {
        path: path.to_path_buf(),
        detail: e.to_string(),
        source: Some(e),
    }
}

/// An error while opening: SQLite's (maybe a lock to wait out) or ours.
enum Setup {
    Sql(rusqlite::Error),
    Hindsight(Error),
}

impl From<rusqlite::Error> for Setup {
    fn from(e: rusqlite::Error) -> Self {
        Setup::Sql(e)
    }
}

fn is_busy(e: &rusqlite::Error) -> bool {
    matches!(e, rusqlite::Error::SqliteFailure(f, _)
        if matches!(f.code, ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked))
}

trait DbResult<T> {
    fn db(self, path: &Path) -> Result<T>;
}

impl<T> DbResult<T> for rusqlite::Result<T> {
    fn db(self, path: &Path) -> Result<T> {
        self.map_err(|e| db_err(path, e))
    }
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn to_u64(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

static RUN_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A new run id `YYYYMMDD-HHMMSS-xxxxxx` for a run started at `started_ms`.
///
/// The 24-bit suffix is a bijective scramble of (a per-process offset derived
/// from the pid, the process's start time and a stack address) + a
/// process-wide counter: ids made by one process never repeat within a
/// second (2^24 of them), and two processes (forks included: the pid is part
/// of the offset) collide only by chance, which [`LogDb::create_run`]
/// catches on insert and retries with the next id.
pub fn new_run_id(started_ms: u64) -> String {
    static NONCE: OnceLock<[u8; 32]> = OnceLock::new();
    let nonce = NONCE.get_or_init(|| {
        let local = 0u8;
        let mut h = blake3::Hasher::new();
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        h.update(&nanos.to_le_bytes());
        h.update(&(std::ptr::addr_of!(local) as usize).to_le_bytes());
        *h.finalize().as_bytes()
    });
    let mut h = blake3::Hasher::new();
    h.update(nonce);
    h.update(&std::process::id().to_le_bytes());
    let b = h.finalize();
    let offset = u32::from_le_bytes([b.as_bytes()[0], b.as_bytes()[1], b.as_bytes()[2], 0]);
    let count = RUN_COUNTER.fetch_add(1, AtomicOrdering::Relaxed) as u32;
    const MASK: u32 = (1 << 24) - 1;
    // Bijections on 24 bits: odd multiplier, xor-shift.
    let mut x = offset.wrapping_add(count) & MASK;
    x = x.wrapping_mul(0x9E_3779) & MASK;
    x ^= x >> 12;
    x = x.wrapping_mul(0x85_EBCB) & MASK;
    x ^= x >> 11;
    format!("{}-{x:06x}", dates::compact_utc(started_ms))
}

/// Content address of a source snapshot (path -> file content): hex BLAKE3
/// of an unambiguous, length-prefixed encoding of the sorted entries.
pub fn source_hash(files: &BTreeMap<String, String>) -> String {
    let mut h = blake3::Hasher::new();
    h.update(b"hindsight-source-v1\0");
    h.update(&(files.len() as u64).to_le_bytes());
    for (path, content) in files {
        h.update(&(path.len() as u64).to_le_bytes());
        h.update(path.as_bytes());
        h.update(&(content.len() as u64).to_le_bytes());
        h.update(content.as_bytes());
    }
    h.finalize().to_hex().to_string()
}

/// Canonical JSON text of a loop context: keys in nesting order.
pub fn ctx_json(ctx: &[(String, i64)]) -> String {
    let mut s = String::from("{");
    for (i, (name, idx)) in ctx.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        // Serializing a &str cannot fail.
        s.push_str(&serde_json::to_string(name).unwrap_or_default());
        s.push(':');
        s.push_str(&idx.to_string());
    }
    s.push('}');
    s
}

fn parse_ctx(text: &str) -> Option<Vec<(String, i64)>> {
    match json::parse(text)? {
        json::J::Obj(entries) => entries
            .into_iter()
            .map(|(k, v)| match v {
                json::J::Num(tok) => tok.parse::<i64>().ok().map(|i| (k, i)),
                _ => None,
            })
            .collect(),
        _ => None,
    }
}

fn check_seconds(what: impl FnOnce() -> String, v: f64) -> Result<f64> {
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(Error::invalid(
            what(),
            format!("{v} is not a finite, non-negative number of seconds"),
        ))
    }
}

fn run_from_row(row: &Row<'_>) -> rusqlite::Result<RunRow> {
    let status: String = row.get(8)?;
    Ok(RunRow {
        id: row.get(0)?,
        script: row.get(1)?,
        script_abs: row.get(2)?,
        project_root: row.get(3)?,
        source_hash: row.get(4)?,
        git_commit: row.get(5)?,
        git_dirty: row.get::<_, Option<i64>>(6)?.map(|v| v != 0),
        args_json: row.get(7)?,
        // The CHECK constraint keeps other values out.
        status: status.parse().unwrap_or(RunStatus::Failed),
        started_ms: to_u64(row.get(9)?),
        ended_ms: row.get::<_, Option<i64>>(10)?.map(to_u64),
        host: row.get(11)?,
        versions_json: row.get(12)?,
        pid: u32::try_from(row.get::<_, i64>(13)?).unwrap_or(0),
        resume_key: row.get(14)?,
        store: row.get(15)?,
    })
}

impl LogDb {
    /// Open (creating it, its parent directory and the schema if needed) the
    /// log database at `path`.
    pub fn open(path: &Path) -> Result<LogDb> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            crate::durable::create_dir_durable(parent)?;
        }
        let conn = Connection::open(path).db(path)?;
        conn.busy_timeout(BUSY_TIMEOUT).db(path)?;
        // Another process may be creating the file right now: the first
        // statements can hit a lock the busy handler does not cover; retry.
        let mut attempt = 0;
        loop {
            match Self::configure(&conn, path) {
                Err(Setup::Sql(e)) if is_busy(&e) && attempt < 100 => {
                    attempt += 1;
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(Setup::Sql(e)) => return Err(db_err(path, e)),
                Err(Setup::Hindsight(e)) => return Err(e),
                Ok(()) => break,
            }
        }
        Ok(LogDb {
            conn,
            path: path.to_path_buf(),
        })
    }

    fn configure(conn: &Connection, path: &Path) -> std::result::Result<(), Setup> {
        // WAL may be unavailable (e.g. some network file systems): the
        // rollback journal then still works, with less concurrency.
        let _mode: String =
            conn.pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.pragma_update(None, "foreign_keys", true)?;
        if Self::schema_version(conn, path)? == SCHEMA_VERSION {
            return Ok(());
        }
        let tx = Transaction::new_unchecked(conn, TransactionBehavior::Immediate)?;
        let found = Self::schema_version(&tx, path)?;
        if found < 1 {
            tx.execute_batch(SCHEMA_V1)?;
        }
        if found < 2 {
            tx.execute_batch(SCHEMA_V2)?;
        }
        if found < SCHEMA_VERSION {
            tx.pragma_update(None, "user_version", SCHEMA_VERSION)?;
        }
        Ok(tx.commit()?)
    }

    fn schema_version(conn: &Connection, path: &Path) -> std::result::Result<i64, Setup> {
        let version: i64 = conn.pragma_query_value(None, "user_version", |r| r.get(0))?;
        if version > SCHEMA_VERSION {
            return Err(Setup::Hindsight(Error::Database {
                path: path.to_path_buf(),
                detail: format!(
                    "schema version {version} is newer than this hindsight supports \
                     ({SCHEMA_VERSION}); upgrade hindsight to read it"
                ),
                source: None,
            }));
        }
        Ok(version)
    }

    /// The database file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Run `f` in one `BEGIN IMMEDIATE` transaction; commit if it succeeds.
    fn write<T>(&self, f: impl FnOnce(&Transaction<'_>) -> Result<T>) -> Result<T> {
        let tx =
            Transaction::new_unchecked(&self.conn, TransactionBehavior::Immediate).db(&self.path)?;
        let out = f(&tx)?;
        tx.commit().db(&self.path)?;
        Ok(out)
    }

    fn not_found(&self, what: &'static str, name: &str) -> Error {
        Error::NotFound {
            what,
            name: name.to_string(),
            location: self.path.display().to_string(),
        }
    }

    fn require_run(&self, conn: &Connection, run_id: &str) -> Result<()> {
        let exists = conn
            .prepare_cached("SELECT 1 FROM runs WHERE id = ?1")
            .and_then(|mut st| st.exists([run_id]))
            .db(&self.path)?;
        if exists {
            Ok(())
        } else {
            Err(self.not_found("run", run_id))
        }
    }

    // ---------------------------------------------------------------- runs

    /// Insert a new run with status `running`; returns its generated id
    /// (unique: an id taken by a concurrent run is never overwritten, the
    /// insert retries with another).
    pub fn create_run(&self, run: &NewRun) -> Result<String> {
        let args = check_json(
            || format!("args of run of {}", run.script),
            &run.args_json,
            true,
        )?;
        let versions = check_json(
            || format!("versions of run of {}", run.script),
            &run.versions_json,
            false,
        )?;
        let started = run.started_ms.unwrap_or_else(now_ms);
        for _ in 0..64 {
            let id = new_run_id(started);
            let inserted = self.write(|tx| {
                tx.prepare_cached(&format!(
                    "INSERT INTO runs ({RUN_COLUMNS}) VALUES \
                     (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, 'running', ?9, NULL, ?10, ?11, ?12, ?13, NULL) \
                     ON CONFLICT (id) DO NOTHING"
                ))
                .and_then(|mut st| {
                    st.execute(params![
                        id,
                        run.script,
                        run.script_abs,
                        run.project_root,
                        run.source_hash,
                        run.git_commit,
                        run.git_dirty.map(i64::from),
                        args,
                        to_i64(started),
                        run.host,
                        versions,
                        i64::from(run.pid),
                        run.resume_key,
                    ])
                })
                .db(&self.path)
            })?;
            if inserted == 1 {
                return Ok(id);
            }
        }
        Err(Error::Database {
            path: self.path.clone(),
            detail: format!(
                "could not find a free run id for {} after 64 tries",
                run.script
            ),
            source: None,
        })
    }

    /// Set a run's status and end time (`ended_ms` is stored as given:
    /// `None` clears it, e.g. when an interrupted run resumes).
    pub fn set_status(&self, run_id: &str, status: RunStatus, ended_ms: Option<u64>) -> Result<()> {
        let changed = self.write(|tx| {
            tx.execute(
                "UPDATE runs SET status = ?2, ended_ms = ?3 WHERE id = ?1",
                params![run_id, status.as_str(), ended_ms.map(to_i64)],
            )
            .db(&self.path)
        })?;
        if changed == 0 {
            return Err(self.not_found("run", run_id));
        }
        Ok(())
    }

    /// Replace a run's recorded arguments (a JSON object): arguments are
    /// discovered one `hs.arg` call at a time, after the run was created.
    pub fn set_args(&self, run_id: &str, args_json: &str) -> Result<()> {
        // The same NaN-tolerant check as `create_run`: `hs.arg("x", nan)` is fine.
        let args_json = &check_json(|| format!("args of run {run_id}"), args_json, true)?;
        let changed = self.write(|tx| {
            tx.execute(
                "UPDATE runs SET args = ?2 WHERE id = ?1",
                params![run_id, args_json],
            )
            .db(&self.path)
        })?;
        if changed == 0 {
            return Err(self.not_found("run", run_id));
        }
        Ok(())
    }

    /// Record the store the run's checkpoints go to (a directory or URL).
    pub fn set_store(&self, run_id: &str, store: &str) -> Result<()> {
        let changed = self.write(|tx| {
            tx.execute(
                "UPDATE runs SET store = ?2 WHERE id = ?1",
                params![run_id, store],
            )
            .db(&self.path)
        })?;
        if changed == 0 {
            return Err(self.not_found("run", run_id));
        }
        Ok(())
    }

    /// One run; `NotFound` naming the id if there is none.
    pub fn run(&self, run_id: &str) -> Result<RunRow> {
        self.conn
            .prepare_cached(&format!("SELECT {RUN_COLUMNS} FROM runs WHERE id = ?1"))
            .and_then(|mut st| st.query_row([run_id], run_from_row).optional())
            .db(&self.path)?
            .ok_or_else(|| self.not_found("run", run_id))
    }

    fn query_runs(&self, sql: &str, params: impl rusqlite::Params) -> Result<Vec<RunRow>> {
        let mut st = self.conn.prepare_cached(sql).db(&self.path)?;
        let rows = st.query_map(params, run_from_row).db(&self.path)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().db(&self.path)
    }

    /// Runs, newest first (by start time, then insertion order); at most `limit`.
    pub fn runs(&self, limit: Option<usize>) -> Result<Vec<RunRow>> {
        let limit = limit.map_or(-1, |l| i64::try_from(l).unwrap_or(i64::MAX));
        self.query_runs(
            &format!(
                "SELECT {RUN_COLUMNS} FROM runs ORDER BY started_ms DESC, rowid DESC LIMIT ?1"
            ),
            [limit],
        )
    }

    /// The newest run, of the given script (absolute path) if `Some`.
    pub fn latest_run(&self, script_abs: Option<&str>) -> Result<Option<RunRow>> {
        let rows = self.query_runs(
            &format!(
                "SELECT {RUN_COLUMNS} FROM runs WHERE ?1 IS NULL OR script_abs = ?1 \
                 ORDER BY started_ms DESC, rowid DESC LIMIT 1"
            ),
            [script_abs],
        )?;
        Ok(rows.into_iter().next())
    }

    /// The newest run with this resume key whose status is `interrupted` or
    /// `running` (a run killed without a chance to say so stays `running`).
    pub fn find_resumable(&self, resume_key: &str) -> Result<Option<RunRow>> {
        let rows = self.query_runs(
            &format!(
                "SELECT {RUN_COLUMNS} FROM runs WHERE resume_key = ?1 \
                 AND status IN ('interrupted', 'running') \
                 ORDER BY started_ms DESC, rowid DESC LIMIT 1"
            ),
            [resume_key],
        )?;
        Ok(rows.into_iter().next())
    }

    // ------------------------------------------------------------- sources

    /// Store a source snapshot (path -> content) unless already present;
    /// returns its content address ([`source_hash`]).
    pub fn put_source(&self, files: &BTreeMap<String, String>) -> Result<String> {
        let hash = source_hash(files);
        let text = serde_json::to_string(files)
            .map_err(|e| Error::invalid("source snapshot", e.to_string()))?;
        self.write(|tx| {
            tx.execute(
                "INSERT INTO sources (hash, files) VALUES (?1, ?2) ON CONFLICT (hash) DO NOTHING",
                params![hash, text],
            )
            .db(&self.path)
        })?;
        Ok(hash)
    }

    /// A stored source snapshot; `NotFound` naming the hash if absent,
    /// `Corrupt` if its content no longer matches the hash.
    pub fn get_source(&self, hash: &str) -> Result<BTreeMap<String, String>> {
        let text: String = self
            .conn
            .prepare_cached("SELECT files FROM sources WHERE hash = ?1")
            .and_then(|mut st| st.query_row([hash], |r| r.get(0)).optional())
            .db(&self.path)?
            .ok_or_else(|| self.not_found("source snapshot", hash))?;
        let files: BTreeMap<String, String> = serde_json::from_str(&text)
            .map_err(|e| Error::corrupt(&self.path, format!("source snapshot {hash}: {e}")))?;
        if source_hash(&files) != hash {
            return Err(Error::corrupt(
                &self.path,
                format!("source snapshot {hash} does not match its hash"),
            ));
        }
        Ok(files)
    }

    // ---------------------------------------------------------------- logs

    /// Append log values of a run in one transaction. A value logged again
    /// with the same name and context in the same phase replaces the old
    /// one (and moves to the end of the sequence), so re-executed
    /// iterations do not duplicate rows.
    pub fn append_logs(&self, run_id: &str, phase: Phase, rows: &[LogRow]) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let mut prepared = Vec::with_capacity(rows.len());
        for row in rows {
            let what = || format!("log '{}' of run {run_id}", row.name);
            if row.name.is_empty() {
                return Err(Error::invalid(
                    format!("log of run {run_id}"),
                    "the name is empty",
                ));
            }
            for (i, (loop_name, _)) in row.ctx.iter().enumerate() {
                if loop_name.is_empty() {
                    return Err(Error::invalid(
                        what(),
                        "a loop name in its context is empty",
                    ));
                }
                if row.ctx[..i].iter().any(|(n, _)| n == loop_name) {
                    return Err(Error::invalid(
                        what(),
                        format!("loop '{loop_name}' appears twice in its context"),
                    ));
                }
            }
            let value = row.value_json.trim();
            if json::parse(value).is_none() {
                return Err(Error::invalid(
                    what(),
                    format!("value is not valid JSON: {value:.80}"),
                ));
            }
            prepared.push((row.name.as_str(), ctx_json(&row.ctx), value));
        }
        let created = to_i64(now_ms());
        self.write(|tx| {
            self.require_run(tx, run_id)?;
            let mut seq: i64 = tx
                .prepare_cached("SELECT COALESCE(MAX(seq), 0) FROM logs WHERE run_id = ?1")
                .and_then(|mut st| st.query_row([run_id], |r| r.get(0)))
                .db(&self.path)?;
            let mut st = tx
                .prepare_cached(
                    "INSERT INTO logs (run_id, name, ctx, value, phase, seq, created_ms) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) \
                     ON CONFLICT (run_id, name, ctx, phase) DO UPDATE SET \
                     value = excluded.value, seq = excluded.seq, created_ms = excluded.created_ms",
                )
                .db(&self.path)?;
            for (name, ctx, value) in &prepared {
                seq += 1;
                st.execute(params![
                    run_id,
                    name,
                    ctx,
                    value,
                    phase.as_str(),
                    seq,
                    created
                ])
                .db(&self.path)?;
            }
            Ok(())
        })
    }

    /// A run's log values in write order (both phases); only `names` if not empty.
    pub fn logs(&self, run_id: &str, names: &[String]) -> Result<Vec<LogRecord>> {
        self.require_run(&self.conn, run_id)?;
        let filter = if names.is_empty() {
            None
        } else {
            Some(
                serde_json::to_string(names)
                    .map_err(|e| Error::invalid("log names", e.to_string()))?,
            )
        };
        let mut st = self
            .conn
            .prepare_cached(
                "SELECT name, ctx, value, phase, seq, created_ms FROM logs \
                 WHERE run_id = ?1 AND (?2 IS NULL OR name IN (SELECT value FROM json_each(?2))) \
                 ORDER BY seq",
            )
            .db(&self.path)?;
        let rows = st
            .query_map(params![run_id, filter], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, String>(3)?,
                    r.get::<_, i64>(4)?,
                    r.get::<_, i64>(5)?,
                ))
            })
            .db(&self.path)?;
        let mut out = Vec::new();
        for row in rows {
            let (name, ctx_text, value_json, phase, seq, created) = row.db(&self.path)?;
            out.push(LogRecord {
                ctx: self.decode_ctx(run_id, &name, &ctx_text)?,
                phase: phase
                    .parse()
                    .map_err(|_| self.bad_row(run_id, &name, "phase"))?,
                name,
                ctx_json: ctx_text,
                value_json,
                seq,
                created_ms: to_u64(created),
            });
        }
        Ok(out)
    }

    fn bad_row(&self, run_id: &str, name: &str, what: &str) -> Error {
        Error::corrupt(
            &self.path,
            format!("log '{name}' of run {run_id} has an invalid {what}"),
        )
    }

    fn decode_ctx(&self, run_id: &str, name: &str, text: &str) -> Result<Vec<(String, i64)>> {
        parse_ctx(text).ok_or_else(|| self.bad_row(run_id, name, "context"))
    }

    /// Names a run logged, in order of first appearance.
    pub fn log_names(&self, run_id: &str) -> Result<Vec<String>> {
        self.require_run(&self.conn, run_id)?;
        let mut st = self
            .conn
            .prepare_cached(
                "SELECT name FROM logs WHERE run_id = ?1 GROUP BY name ORDER BY MIN(seq)",
            )
            .db(&self.path)?;
        let rows = st.query_map([run_id], |r| r.get(0)).db(&self.path)?;
        rows.collect::<rusqlite::Result<Vec<String>>>()
            .db(&self.path)
    }

    /// Values logged in both phases at the same name and context whose
    /// replay value differs from the recorded one (see
    /// [`json::values_equal`]), in record order: the first divergence first.
    pub fn divergences(&self, run_id: &str) -> Result<Vec<Divergence>> {
        self.require_run(&self.conn, run_id)?;
        let mut st = self
            .conn
            .prepare_cached(
                "SELECT r.name, r.ctx, r.value, p.value, r.seq FROM logs r \
                 JOIN logs p ON p.run_id = r.run_id AND p.name = r.name AND p.ctx = r.ctx \
                      AND p.phase = 'replay' \
                 WHERE r.run_id = ?1 AND r.phase = 'record' ORDER BY r.seq",
            )
            .db(&self.path)?;
        let rows = st
            .query_map([run_id], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, String>(3)?,
                    r.get::<_, i64>(4)?,
                ))
            })
            .db(&self.path)?;
        let mut out = Vec::new();
        for row in rows {
            let (name, ctx_text, record_value, replay_value, record_seq) = row.db(&self.path)?;
            if json::values_equal(&record_value, &replay_value) {
                continue;
            }
            out.push(Divergence {
                ctx: self.decode_ctx(run_id, &name, &ctx_text)?,
                name,
                ctx_json: ctx_text,
                record_value,
                replay_value,
                record_seq,
            });
        }
        Ok(out)
    }

    // ---------------------------------------------------------- iterations

    /// Record (insert or replace) one loop iteration's timing.
    pub fn record_iteration(&self, run_id: &str, row: &IterationRow) -> Result<()> {
        self.record_iterations(run_id, std::slice::from_ref(row))
    }

    /// Record (insert or replace) several iterations in one transaction.
    pub fn record_iterations(&self, run_id: &str, rows: &[IterationRow]) -> Result<()> {
        for row in rows {
            let what = || format!("iteration {}[{}] of run {run_id}", row.loop_name, row.idx);
            if row.loop_name.is_empty() {
                return Err(Error::invalid(what(), "the loop name is empty"));
            }
            if i64::try_from(row.idx).is_err() {
                return Err(Error::invalid(what(), "index out of range"));
            }
            check_seconds(what, row.seconds)?;
            for v in [row.materialize_seconds, row.restore_seconds]
                .into_iter()
                .flatten()
            {
                check_seconds(what, v)?;
            }
        }
        self.write(|tx| {
            self.require_run(tx, run_id)?;
            let mut st = tx
                .prepare_cached(
                    "INSERT OR REPLACE INTO iterations \
                     (run_id, loop_name, idx, seconds, checkpoint, materialize_seconds, restore_seconds) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
                )
                .db(&self.path)?;
            for row in rows {
                st.execute(params![
                    run_id,
                    row.loop_name,
                    to_i64(row.idx),
                    row.seconds,
                    row.checkpoint,
                    row.materialize_seconds,
                    row.restore_seconds,
                ])
                .db(&self.path)?;
            }
            Ok(())
        })
    }

    /// Store the measured time to restore an iteration's checkpoint (replay),
    /// leaving its other fields alone. `NotFound` if the iteration was never recorded.
    pub fn set_restore_seconds(
        &self,
        run_id: &str,
        loop_name: &str,
        idx: u64,
        seconds: f64,
    ) -> Result<()> {
        check_seconds(
            || format!("restore time of {loop_name}[{idx}] of run {run_id}"),
            seconds,
        )?;
        let changed = self.write(|tx| {
            self.require_run(tx, run_id)?;
            tx.execute(
                "UPDATE iterations SET restore_seconds = ?4 WHERE run_id = ?1 AND loop_name = ?2 AND idx = ?3",
                params![run_id, loop_name, to_i64(idx), seconds],
            )
            .db(&self.path)
        })?;
        if changed == 0 {
            return Err(self.not_found("iteration", &format!("{loop_name}[{idx}] of run {run_id}")));
        }
        Ok(())
    }

    /// A run's recorded iterations of one loop, by index.
    pub fn iterations(&self, run_id: &str, loop_name: &str) -> Result<Vec<IterationRow>> {
        self.require_run(&self.conn, run_id)?;
        let mut st = self
            .conn
            .prepare_cached(
                "SELECT loop_name, idx, seconds, checkpoint, materialize_seconds, restore_seconds \
                 FROM iterations WHERE run_id = ?1 AND loop_name = ?2 ORDER BY idx",
            )
            .db(&self.path)?;
        let rows = st
            .query_map([run_id, loop_name], |r| {
                Ok(IterationRow {
                    loop_name: r.get(0)?,
                    idx: to_u64(r.get(1)?),
                    seconds: r.get(2)?,
                    checkpoint: r.get(3)?,
                    materialize_seconds: r.get(4)?,
                    restore_seconds: r.get(5)?,
                })
            })
            .db(&self.path)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().db(&self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;
    use std::process::Command;

    fn new_run(script: &str) -> NewRun {
        NewRun {
            script: script.into(),
            script_abs: format!("/proj/{script}"),
            project_root: "/proj".into(),
            source_hash: "abc".into(),
            args_json: r#"{"lr": 0.1, "epochs": 3}"#.into(),
            host: "host1".into(),
            versions_json: r#"{"python": "3.12"}"#.into(),
            pid: 42,
            ..NewRun::default()
        }
    }

    fn row(name: &str, ctx: &[(&str, i64)], value: &str) -> LogRow {
        LogRow {
            name: name.into(),
            ctx: ctx.iter().map(|(n, i)| (n.to_string(), *i)).collect(),
            value_json: value.into(),
        }
    }

    fn temp_db() -> (tempfile::TempDir, LogDb) {
        let dir = tempfile::tempdir().unwrap();
        let db = LogDb::open(&dir.path().join("sub/dir/hindsight.db")).unwrap();
        (dir, db)
    }

    #[test]
    fn log_db_is_send() {
        fn assert_send<T: Send>() {}
        assert_send::<LogDb>();
    }

    #[test]
    fn run_ids_start_with_the_utc_date() {
        // 2024-02-29 23:59:59.999 UTC (leap day).
        assert!(new_run_id(1_709_251_199_999).starts_with("20240229-235959-"));
        assert!(new_run_id(978_266_096_000).starts_with("20001231-123456-"));
    }

    #[test]
    fn run_ids_are_unique_in_the_same_millisecond() {
        let ms = 1_700_000_000_123;
        let ids: HashSet<String> = (0..200_000).map(|_| new_run_id(ms)).collect();
        assert_eq!(ids.len(), 200_000);
        let id = ids.iter().next().unwrap();
        assert_eq!(id.len(), "YYYYMMDD-HHMMSS-xxxxxx".len());
        assert!(id.starts_with("20231114-221320-"), "{id}");
        assert!(id[16..].bytes().all(|b| b.is_ascii_hexdigit()));
    }

    #[test]
    fn create_list_and_status() {
        let (_dir, db) = temp_db();
        assert!(db.runs(None).unwrap().is_empty());
        assert_eq!(db.latest_run(None).unwrap(), None);

        let mut a = new_run("train.py");
        a.started_ms = Some(1_000);
        a.git_commit = Some("deadbeef".into());
        a.git_dirty = Some(true);
        a.resume_key = Some("k1".into());
        let id_a = db.create_run(&a).unwrap();
        let mut b = new_run("eval.py");
        b.started_ms = Some(2_000);
        b.args_json = String::new(); // empty means {}
        let id_b = db.create_run(&b).unwrap();
        let mut c = new_run("train.py");
        c.started_ms = Some(2_000); // same start as b: both kept, newest inserted first
        let id_c = db.create_run(&c).unwrap();
        assert_ne!(id_b, id_c);

        let ra = db.run(&id_a).unwrap();
        assert_eq!(ra.script, "train.py");
        assert_eq!(ra.script_abs, "/proj/train.py");
        assert_eq!(ra.status, RunStatus::Running);
        assert_eq!(ra.started_ms, 1_000);
        assert_eq!(ra.ended_ms, None);
        assert_eq!(ra.git_commit.as_deref(), Some("deadbeef"));
        assert_eq!(ra.git_dirty, Some(true));
        assert_eq!(ra.args_json, r#"{"lr": 0.1, "epochs": 3}"#);
        assert_eq!(ra.versions_json, r#"{"python": "3.12"}"#);
        assert_eq!((ra.pid, ra.host.as_str()), (42, "host1"));
        assert_eq!(ra.resume_key.as_deref(), Some("k1"));
        assert_eq!(db.run(&id_b).unwrap().args_json, "{}");
        assert_eq!(db.run(&id_b).unwrap().git_dirty, None);

        let ids: Vec<String> = db.runs(None).unwrap().into_iter().map(|r| r.id).collect();
        assert_eq!(ids, vec![id_c.clone(), id_b.clone(), id_a.clone()]);
        assert_eq!(db.runs(Some(1)).unwrap().len(), 1);
        assert_eq!(db.latest_run(None).unwrap().unwrap().id, id_c);
        assert_eq!(
            db.latest_run(Some("/proj/eval.py")).unwrap().unwrap().id,
            id_b
        );
        assert_eq!(db.latest_run(Some("/nope.py")).unwrap(), None);

        db.set_status(&id_a, RunStatus::Completed, Some(5_000))
            .unwrap();
        let ra = db.run(&id_a).unwrap();
        assert_eq!(
            (ra.status, ra.ended_ms),
            (RunStatus::Completed, Some(5_000))
        );
        assert_eq!(
            "interrupted".parse::<RunStatus>().unwrap(),
            RunStatus::Interrupted
        );
        assert!("done".parse::<RunStatus>().is_err());
        assert_eq!(RunStatus::Failed.to_string(), "failed");
        assert_eq!("replay".parse::<Phase>().unwrap(), Phase::Replay);

        // Default start time is now.
        let before = now_ms();
        let id_d = db.create_run(&new_run("x.py")).unwrap();
        assert!(db.run(&id_d).unwrap().started_ms >= before);
    }

    #[test]
    fn invalid_run_arguments() {
        let (_dir, db) = temp_db();
        let mut r = new_run("train.py");
        r.args_json = "[1, 2]".into();
        let e = db.create_run(&r).unwrap_err();
        assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
        assert!(e.to_string().contains("train.py"), "{e}");
        r.args_json = "{oops".into();
        assert!(db.create_run(&r).is_err());
        r.args_json = "{}".into();
        r.versions_json = "not json".into();
        assert!(db.create_run(&r).is_err());
    }

    #[test]
    fn resumable_runs() {
        let (_dir, db) = temp_db();
        let mk = |ms: u64, key: &str| {
            let mut r = new_run("train.py");
            r.started_ms = Some(ms);
            r.resume_key = Some(key.into());
            db.create_run(&r).unwrap()
        };
        let old = mk(1, "k");
        let newer = mk(2, "k");
        let other = mk(3, "other");
        db.set_status(&old, RunStatus::Interrupted, Some(10))
            .unwrap();
        db.set_status(&newer, RunStatus::Completed, Some(20))
            .unwrap();
        assert_eq!(db.find_resumable("k").unwrap().unwrap().id, old);
        // A run that died without updating its status is still `running`.
        assert_eq!(db.find_resumable("other").unwrap().unwrap().id, other);
        db.set_status(&other, RunStatus::Failed, Some(30)).unwrap();
        assert_eq!(db.find_resumable("other").unwrap(), None);
        assert_eq!(db.find_resumable("none").unwrap(), None);
        // Resuming: back to running, end time cleared.
        db.set_status(&old, RunStatus::Running, None).unwrap();
        let r = db.run(&old).unwrap();
        assert_eq!((r.status, r.ended_ms), (RunStatus::Running, None));
    }

    #[test]
    fn unknown_run_id_errors_name_it() {
        let (_dir, db) = temp_db();
        let check = |e: Error| {
            assert!(matches!(e, Error::NotFound { what: "run", .. }), "{e}");
            let msg = e.to_string();
            assert!(msg.contains("20990101-000000-abcdef"), "{msg}");
            assert!(msg.contains("hindsight.db"), "{msg}");
        };
        let id = "20990101-000000-abcdef";
        check(db.run(id).unwrap_err());
        check(db.set_status(id, RunStatus::Failed, None).unwrap_err());
        check(
            db.append_logs(id, Phase::Record, &[row("loss", &[], "1")])
                .unwrap_err(),
        );
        check(db.logs(id, &[]).unwrap_err());
        check(db.log_names(id).unwrap_err());
        check(db.divergences(id).unwrap_err());
        check(db.iterations(id, "epoch").unwrap_err());
        let it = IterationRow {
            loop_name: "epoch".into(),
            idx: 0,
            seconds: 1.0,
            checkpoint: None,
            materialize_seconds: None,
            restore_seconds: None,
        };
        check(db.record_iteration(id, &it).unwrap_err());
        check(db.set_restore_seconds(id, "epoch", 0, 1.0).unwrap_err());
    }

    #[test]
    fn sources_are_content_addressed() {
        let (_dir, db) = temp_db();
        let mut files = BTreeMap::new();
        files.insert("train.py".to_string(), "print('hi')\n".to_string());
        files.insert("lib/util.py".to_string(), "X = 1\n".to_string());
        let h = db.put_source(&files).unwrap();
        assert_eq!(h.len(), 64);
        assert_eq!(db.put_source(&files).unwrap(), h); // idempotent
        assert_eq!(db.get_source(&h).unwrap(), files);
        // Different content, different hash; boundaries are unambiguous.
        let mut a = BTreeMap::new();
        a.insert("ab".to_string(), "c".to_string());
        let mut b = BTreeMap::new();
        b.insert("a".to_string(), "bc".to_string());
        assert_ne!(source_hash(&a), source_hash(&b));
        assert_ne!(source_hash(&BTreeMap::new()), source_hash(&a));
        let e = db.get_source("feedface").unwrap_err();
        assert!(
            matches!(e, Error::NotFound { .. }) && e.to_string().contains("feedface"),
            "{e}"
        );
        // Tampered content is detected.
        db.conn
            .execute(
                "UPDATE sources SET files = '{\"train.py\":\"evil\"}' WHERE hash = ?1",
                [&h],
            )
            .unwrap();
        assert!(matches!(
            db.get_source(&h).unwrap_err(),
            Error::Corrupt { .. }
        ));
    }

    #[test]
    fn logs_upsert_and_order() {
        let (_dir, db) = temp_db();
        let id = db.create_run(&new_run("train.py")).unwrap();
        db.append_logs(
            &id,
            Phase::Record,
            &[
                row("lr", &[], "0.1"),
                row("loss", &[("epoch", 0), ("step", 0)], "2.5"),
                row("loss", &[("epoch", 0), ("step", 1)], "2.0"),
                row("acc", &[("epoch", 0)], "0.5"),
            ],
        )
        .unwrap();
        // A resumed iteration re-logs step 1: replaced, not duplicated.
        db.append_logs(
            &id,
            Phase::Record,
            &[row("loss", &[("epoch", 0), ("step", 1)], "1.9")],
        )
        .unwrap();
        // The replay phase keeps its own rows.
        db.append_logs(
            &id,
            Phase::Replay,
            &[row("loss", &[("epoch", 0), ("step", 1)], "1.9")],
        )
        .unwrap();
        db.append_logs(&id, Phase::Record, &[]).unwrap();

        let all = db.logs(&id, &[]).unwrap();
        let summary: Vec<(&str, &str, &str, Phase)> = all
            .iter()
            .map(|r| {
                (
                    r.name.as_str(),
                    r.ctx_json.as_str(),
                    r.value_json.as_str(),
                    r.phase,
                )
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                ("lr", "{}", "0.1", Phase::Record),
                ("loss", r#"{"epoch":0,"step":0}"#, "2.5", Phase::Record),
                ("acc", r#"{"epoch":0}"#, "0.5", Phase::Record),
                ("loss", r#"{"epoch":0,"step":1}"#, "1.9", Phase::Record),
                ("loss", r#"{"epoch":0,"step":1}"#, "1.9", Phase::Replay),
            ]
        );
        assert!(all.windows(2).all(|w| w[0].seq < w[1].seq));
        assert_eq!(
            all[1].ctx,
            vec![("epoch".to_string(), 0), ("step".to_string(), 0)]
        );
        assert!(all[0].ctx.is_empty());
        assert!(all[0].created_ms > 0);

        let loss = db
            .logs(&id, &["loss".to_string(), "missing".to_string()])
            .unwrap();
        assert_eq!(loss.len(), 3);
        assert!(loss.iter().all(|r| r.name == "loss"));
        assert_eq!(db.log_names(&id).unwrap(), vec!["lr", "loss", "acc"]);

        // Keys are kept in nesting order (not sorted) and escaped.
        let odd = [("z\"q", 1), ("a", -2)];
        db.append_logs(
            &id,
            Phase::Record,
            &[row("x", &odd, "{\"k\": [1, NaN, \"s\"]}")],
        )
        .unwrap();
        let x = db.logs(&id, &["x".to_string()]).unwrap();
        assert_eq!(x[0].ctx_json, r#"{"z\"q":1,"a":-2}"#);
        assert_eq!(
            x[0].ctx,
            vec![("z\"q".to_string(), 1), ("a".to_string(), -2)]
        );
    }

    #[test]
    fn invalid_log_rows_are_rejected_whole_batch() {
        let (_dir, db) = temp_db();
        let id = db.create_run(&new_run("train.py")).unwrap();
        for bad in [
            row("", &[], "1"),
            row("loss", &[("", 1)], "1"),
            row("loss", &[("epoch", 1), ("epoch", 2)], "1"),
            row("loss", &[], "{not json"),
            row("loss", &[], ""),
        ] {
            let e = db
                .append_logs(&id, Phase::Record, &[row("ok", &[], "1"), bad])
                .unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
            assert!(e.to_string().contains(&id), "{e}");
        }
        assert!(db.logs(&id, &[]).unwrap().is_empty());
    }

    #[test]
    fn json_value_comparison() {
        for (a, b) in [
            ("1", "1.0"),
            ("1e3", "1000"),
            ("NaN", "NaN"),
            (" 2.50 ", "2.5"),
            ("Infinity", "Infinity"),
            ("[1, 2.0, NaN]", "[1.0,2,NaN]"),
            (
                r#"{"a": 1, "b": [true, null]}"#,
                r#"{"b":[true,null],"a":1.0}"#,
            ),
            (r#""x""#, r#""x""#),
            (r#""\u00e9""#, r#""é""#),
            ("-0.0", "0"),
        ] {
            assert!(json::values_equal(a, b), "{a} vs {b}");
        }
        for (a, b) in [
            ("1", "1.0000001"),
            ("NaN", "1"),
            ("Infinity", "-Infinity"),
            ("9007199254740993", "9007199254740992"), // exact integers
            ("[1, 2]", "[1, 2, 3]"),
            (r#"{"a": 1}"#, r#"{"b": 1}"#),
            (r#""1""#, "1"),
            ("true", "1"),
            ("null", "0"),
            ("oops", "oops2"),
        ] {
            assert!(!json::values_equal(a, b), "{a} vs {b}");
        }
        assert!(json::values_equal("oops", " oops"));
        // Deep nesting does not overflow the stack.
        let deep = "[".repeat(100_000);
        assert!(!json::values_equal(&deep, "[]"));
    }

    #[test]
    fn divergence_detection() {
        let (_dir, db) = temp_db();
        let id = db.create_run(&new_run("train.py")).unwrap();
        let rec = [
            row("loss", &[("epoch", 0)], "1.0"),
            row("loss", &[("epoch", 1)], "0.5"),
            row("loss", &[("epoch", 2)], "NaN"),
            row("acc", &[("epoch", 2)], "[0.1, 0.2]"),
            row("loss", &[("epoch", 3)], "NaN"),
            row("tag", &[], "\"a\""),
            row("only_record", &[], "1"),
        ];
        db.append_logs(&id, Phase::Record, &rec).unwrap();
        // Replay in a different order (parallel workers), different formatting.
        let rep = [
            row("tag", &[], "\"b\""),
            row("loss", &[("epoch", 3)], "0.25"),
            row("acc", &[("epoch", 2)], "[0.1,0.2]"),
            row("loss", &[("epoch", 2)], "NaN"),
            row("loss", &[("epoch", 1)], "0.50000001"),
            row("loss", &[("epoch", 0)], "1"),
            row("only_replay", &[], "2"),
        ];
        db.append_logs(&id, Phase::Replay, &rep).unwrap();
        let d = db.divergences(&id).unwrap();
        let summary: Vec<(&str, &str, &str, &str)> = d
            .iter()
            .map(|x| {
                (
                    x.name.as_str(),
                    x.ctx_json.as_str(),
                    x.record_value.as_str(),
                    x.replay_value.as_str(),
                )
            })
            .collect();
        assert_eq!(
            summary,
            vec![
                ("loss", r#"{"epoch":1}"#, "0.5", "0.50000001"),
                ("loss", r#"{"epoch":3}"#, "NaN", "0.25"),
                ("tag", "{}", "\"a\"", "\"b\""),
            ]
        );
        assert_eq!(d[0].ctx, vec![("epoch".to_string(), 1)]);
        assert!(d[0].record_seq < d[1].record_seq);
        // Fixing the replay value removes the divergence (upsert).
        db.append_logs(&id, Phase::Replay, &[row("tag", &[], "\"a\"")])
            .unwrap();
        assert_eq!(db.divergences(&id).unwrap().len(), 2);
    }

    #[test]
    fn iterations_upsert() {
        let (_dir, db) = temp_db();
        let id = db.create_run(&new_run("train.py")).unwrap();
        let it = |idx: u64, secs: f64, ck: Option<&str>| IterationRow {
            loop_name: "epoch".into(),
            idx,
            seconds: secs,
            checkpoint: ck.map(String::from),
            materialize_seconds: ck.map(|_| 0.5),
            restore_seconds: None,
        };
        db.record_iteration(&id, &it(1, 2.0, None)).unwrap();
        db.record_iterations(&id, &[it(0, 1.0, Some("ck-0")), it(2, 3.0, Some("ck-2"))])
            .unwrap();
        // Re-executed iteration replaces its row.
        db.record_iteration(&id, &it(1, 2.5, Some("ck-1"))).unwrap();
        db.set_restore_seconds(&id, "epoch", 1, 0.7).unwrap();
        let e = db.set_restore_seconds(&id, "epoch", 9, 0.7).unwrap_err();
        assert!(
            matches!(e, Error::NotFound { .. }) && e.to_string().contains("epoch[9]"),
            "{e}"
        );
        let rows = db.iterations(&id, "epoch").unwrap();
        assert_eq!(rows.len(), 3);
        assert_eq!(
            rows.iter().map(|r| r.idx).collect::<Vec<_>>(),
            vec![0, 1, 2]
        );
        assert_eq!(rows[1].seconds, 2.5);
        assert_eq!(rows[1].checkpoint.as_deref(), Some("ck-1"));
        assert_eq!(rows[1].restore_seconds, Some(0.7));
        assert_eq!(rows[0].materialize_seconds, Some(0.5));
        assert!(db.iterations(&id, "step").unwrap().is_empty());
        for bad in [f64::NAN, -1.0, f64::INFINITY] {
            let e = db.record_iteration(&id, &it(5, bad, None)).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
            assert!(e.to_string().contains("epoch[5]"), "{e}");
        }
    }

    #[test]
    fn reopen_persists_everything() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("hindsight.db");
        let (id, hash) = {
            let db = LogDb::open(&path).unwrap();
            let mut files = BTreeMap::new();
            files.insert("train.py".to_string(), "pass\n".to_string());
            let hash = db.put_source(&files).unwrap();
            let mut r = new_run("train.py");
            r.source_hash = hash.clone();
            let id = db.create_run(&r).unwrap();
            db.append_logs(&id, Phase::Record, &[row("loss", &[("epoch", 0)], "1.5")])
                .unwrap();
            db.record_iteration(
                &id,
                &IterationRow {
                    loop_name: "epoch".into(),
                    idx: 0,
                    seconds: 1.0,
                    checkpoint: Some("c0".into()),
                    materialize_seconds: Some(0.1),
                    restore_seconds: None,
                },
            )
            .unwrap();
            db.set_status(&id, RunStatus::Completed, Some(99)).unwrap();
            (id, hash)
        };
        let db = LogDb::open(&path).unwrap();
        assert_eq!(db.path(), path);
        let r = db.run(&id).unwrap();
        assert_eq!(
            (r.status, r.source_hash.as_str()),
            (RunStatus::Completed, hash.as_str())
        );
        assert_eq!(db.get_source(&hash).unwrap()["train.py"], "pass\n");
        assert_eq!(db.logs(&id, &[]).unwrap()[0].value_json, "1.5");
        assert_eq!(
            db.iterations(&id, "epoch").unwrap()[0]
                .checkpoint
                .as_deref(),
            Some("c0")
        );
        let mode: String = db
            .conn
            .query_row("PRAGMA journal_mode", [], |r| r.get(0))
            .unwrap();
        assert_eq!(mode, "wal");
        let v: i64 = db
            .conn
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(v, SCHEMA_VERSION);
    }

    #[test]
    fn version_1_database_is_upgraded_in_place_and_keeps_its_runs() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.db");
        {
            // A database as the first release wrote it.
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch(SCHEMA_V1).unwrap();
            conn.pragma_update(None, "user_version", 1).unwrap();
            conn.execute(
                "INSERT INTO runs (id, script, script_abs, project_root, source_hash, args, \
                 status, started_ms, host, versions, pid) VALUES ('r1', 't.py', '/p/t.py', '/p', \
                 'h', '{}', 'completed', 5, 'host', '{}', 7)",
                [],
            )
            .unwrap();
        }
        let db = LogDb::open(&path).unwrap();
        let r = db.run("r1").unwrap();
        assert_eq!((r.status, r.store), (RunStatus::Completed, None));
        db.set_store("r1", "s3://bucket/ckpts").unwrap();
        assert_eq!(
            db.run("r1").unwrap().store.as_deref(),
            Some("s3://bucket/ckpts")
        );
        assert!(matches!(
            db.set_store("nope", "/x"),
            Err(Error::NotFound { .. })
        ));
        drop(db);
        // Opening again does not try to add the column twice.
        assert_eq!(
            LogDb::open(&path)
                .unwrap()
                .run("r1")
                .unwrap()
                .store
                .as_deref(),
            Some("s3://bucket/ckpts")
        );
    }

    #[test]
    fn newer_schema_version_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("future.db");
        drop(LogDb::open(&path).unwrap());
        Connection::open(&path)
            .unwrap()
            .pragma_update(None, "user_version", SCHEMA_VERSION + 1)
            .unwrap();
        let e = LogDb::open(&path).unwrap_err();
        assert!(matches!(e, Error::Database { .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("future.db")
                && msg.contains(&format!("schema version {}", SCHEMA_VERSION + 1)),
            "{msg}"
        );
    }

    #[test]
    fn not_a_database_is_corrupt() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("garbage.db");
        std::fs::write(&path, vec![0x5a; 8192]).unwrap();
        let e = LogDb::open(&path).unwrap_err();
        assert!(matches!(e, Error::Corrupt { .. }), "{e}");
        assert!(e.to_string().contains("garbage.db"), "{e}");
    }

    #[test]
    fn open_fails_cleanly_when_parent_is_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        let e = LogDb::open(&file.join("db.sqlite")).unwrap_err();
        assert!(e.to_string().contains("file"), "{e}");
    }

    fn append_many(db: &LogDb, run_id: &str, tag: &str, n: usize, batch: usize) {
        let rows: Vec<LogRow> = (0..n)
            .map(|i| row(&format!("v_{tag}"), &[("step", i as i64)], &i.to_string()))
            .collect();
        for chunk in rows.chunks(batch) {
            db.append_logs(run_id, Phase::Record, chunk).unwrap();
        }
    }

    fn check_concurrent_result(db: &LogDb, run_id: &str, tags: &[&str], n: usize) {
        let all = db.logs(run_id, &[]).unwrap();
        assert_eq!(all.len(), tags.len() * n);
        let seqs: HashSet<i64> = all.iter().map(|r| r.seq).collect();
        assert_eq!(seqs.len(), all.len(), "sequence numbers must be unique");
        for tag in tags {
            let mine: Vec<&LogRecord> = all
                .iter()
                .filter(|r| r.name == format!("v_{tag}"))
                .collect();
            assert_eq!(mine.len(), n, "rows of {tag}");
            // Each writer's rows keep their order.
            for (i, r) in mine.iter().enumerate() {
                assert_eq!(r.ctx, vec![("step".to_string(), i as i64)]);
                assert_eq!(r.value_json, i.to_string());
            }
        }
    }

    #[test]
    fn two_threads_with_separate_connections() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("shared.db");
        let id = LogDb::open(&path)
            .unwrap()
            .create_run(&new_run("train.py"))
            .unwrap();
        std::thread::scope(|s| {
            for (tag, batch) in [("a", 1), ("b", 100)] {
                let (path, id) = (&path, &id);
                s.spawn(move || {
                    let db = LogDb::open(path).unwrap();
                    append_many(&db, id, tag, 2000, batch);
                });
            }
        });
        check_concurrent_result(&LogDb::open(&path).unwrap(), &id, &["a", "b"], 2000);
    }

    #[test]
    fn concurrent_first_open_and_run_creation() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fresh.db");
        let ids: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| {
                    let path = &path;
                    s.spawn(move || {
                        let db = LogDb::open(path).unwrap();
                        let mut r = new_run("train.py");
                        r.started_ms = Some(1_700_000_000_000); // all in the same millisecond
                        (0..50)
                            .map(|_| db.create_run(&r).unwrap())
                            .collect::<Vec<_>>()
                    })
                })
                .collect();
            handles
                .into_iter()
                .flat_map(|h| h.join().unwrap())
                .collect()
        });
        let unique: HashSet<&String> = ids.iter().collect();
        assert_eq!(unique.len(), 200);
        assert_eq!(LogDb::open(&path).unwrap().runs(None).unwrap().len(), 200);
    }

    const CHILD_ENV: &str = "HINDSIGHT_LOGDB_TEST_CHILD";

    /// Body of the child processes of `two_processes_append_concurrently`;
    /// a no-op in a normal test run.
    #[test]
    fn child_process_appender() {
        let Ok(spec) = std::env::var(CHILD_ENV) else {
            return;
        };
        let mut parts = spec.splitn(3, '|');
        let (Some(path), Some(run_id), Some(tag)) = (parts.next(), parts.next(), parts.next())
        else {
            panic!("bad {CHILD_ENV}: {spec}");
        };
        let db = LogDb::open(Path::new(path)).unwrap();
        let mut r = new_run("child.py");
        r.started_ms = Some(1_700_000_000_000);
        for i in 0..2000 {
            db.append_logs(
                run_id,
                Phase::Record,
                &[row(&format!("v_{tag}"), &[("step", i)], &i.to_string())],
            )
            .unwrap();
            if i % 40 == 0 {
                db.create_run(&r).unwrap();
            }
        }
    }

    #[test]
    fn two_processes_append_concurrently() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("procs.db");
        let id = LogDb::open(&path)
            .unwrap()
            .create_run(&new_run("train.py"))
            .unwrap();
        let exe = std::env::current_exe().unwrap();
        let children: Vec<_> = ["p", "q"]
            .iter()
            .map(|tag| {
                Command::new(&exe)
                    .args([
                        "--exact",
                        "logdb::tests::child_process_appender",
                        "--test-threads=1",
                        "--nocapture",
                    ])
                    .env(CHILD_ENV, format!("{}|{id}|{tag}", path.display()))
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        for child in children {
            let out = child.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "child failed: {}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            // The filter matched the child test (not zero tests).
            assert!(String::from_utf8_lossy(&out.stdout).contains("1 passed"));
        }
        let db = LogDb::open(&path).unwrap();
        check_concurrent_result(&db, &id, &["p", "q"], 2000);
        // 2 x 50 runs created in the same millisecond from two processes, none lost.
        assert_eq!(db.runs(None).unwrap().len(), 101);
    }
}
