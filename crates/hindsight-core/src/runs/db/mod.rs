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

use std::io;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rusqlite::{Connection, ErrorCode, Transaction, TransactionBehavior};

use crate::error::{Error, Result};

/// The way forward named by every error about a damaged run database.
pub const REPAIR_HINT: &str = "`hindsight repair` rebuilds it from what is still readable \
     (the damaged file is kept beside it)";

/// Schema version this build writes (`PRAGMA user_version`).
pub const SCHEMA_VERSION: i64 = 7;

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

/// Version 3: `rep`, the occurrence of a name within one loop context (the
/// k-th `hs.log("x", ...)` in one step is rep k-1), so repeated values are
/// all kept. SQLite cannot change a UNIQUE constraint in place: the table is
/// rebuilt, existing rows becoming rep 0.
const SCHEMA_V3: &str = r#"
CREATE TABLE logs_v3 (
    run_id     TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    name       TEXT NOT NULL,
    ctx        TEXT NOT NULL,
    rep        INTEGER NOT NULL DEFAULT 0,
    value      TEXT NOT NULL,
    phase      TEXT NOT NULL CHECK (phase IN ('record', 'replay')),
    seq        INTEGER NOT NULL,
    created_ms INTEGER NOT NULL,
    UNIQUE (run_id, name, ctx, rep, phase)
);
INSERT INTO logs_v3 (run_id, name, ctx, value, phase, seq, created_ms)
    SELECT run_id, name, ctx, value, phase, seq, created_ms FROM logs;
DROP TABLE logs;
ALTER TABLE logs_v3 RENAME TO logs;
CREATE INDEX logs_by_seq ON logs (run_id, seq);
"#;

/// Version 4: the value an outer iteration iterated over, when it is an
/// integer (`epoch` = 1 for the first iteration of `range(1, N)`), beside
/// its position.
const SCHEMA_V4: &str = "ALTER TABLE iterations ADD COLUMN value INTEGER;";

/// Version 5: what makes a replay or a resume check itself.
/// - `batches`: a fingerprint of what each training step consumed (its
///   batch), by outer iteration and step, written while recording; a resume
///   and every replay worker compare what they consume with it.
/// - `replays` and `replay_logs`: one row per `hindsight replay` of a run,
///   and the values its workers wrote, staged there until the driver has
///   compared them with the recording ([`LogDb::finish_replay`]); only then
///   do they join `logs`, with `flag` saying how far they can be trusted
///   (NULL: exact; `inexact`: another thread count; `diverged`: kept on
///   request although the replay diverged).
const SCHEMA_V5: &str = r#"
CREATE TABLE batches (
    run_id  TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    outer   INTEGER NOT NULL,
    step    INTEGER NOT NULL,
    digest  TEXT NOT NULL,
    PRIMARY KEY (run_id, outer, step)
) WITHOUT ROWID;
CREATE TABLE replays (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id      TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    exact       INTEGER NOT NULL,
    status      TEXT NOT NULL,
    started_ms  INTEGER NOT NULL,
    ended_ms    INTEGER
);
CREATE TABLE replay_logs (
    replay_id  INTEGER NOT NULL,
    run_id     TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    name       TEXT NOT NULL,
    ctx        TEXT NOT NULL,
    rep        INTEGER NOT NULL,
    value      TEXT NOT NULL,
    seq        INTEGER NOT NULL,
    created_ms INTEGER NOT NULL,
    UNIQUE (replay_id, name, ctx, rep)
);
CREATE INDEX replay_logs_by_seq ON replay_logs (replay_id, seq);
ALTER TABLE logs ADD COLUMN flag TEXT;
"#;

/// Version 6: a checksum per value row (`sum`, see [`row_sum`]), written
/// with the row and checked wherever values are read. SQLite's own checks
/// see pages and indexes, not a changed digit inside a value: a flipped bit
/// in `logs.db` gave wrong values with no error.
const SCHEMA_V6: &str = r#"
ALTER TABLE logs ADD COLUMN sum INTEGER;
UPDATE logs SET sum = hs_row_sum(run_id, name, ctx, rep, value, phase, flag);
ALTER TABLE replay_logs ADD COLUMN sum INTEGER;
UPDATE replay_logs SET sum = hs_row_sum(run_id, name, ctx, rep, value, 'staged:' || replay_id, NULL);
"#;

/// Version 7: batch fingerprints per rank and per kind.
/// - `rank`: a job of several ranks feeds each rank its own batches;
///   keeping rank 0's alone left the others' data order unchecked on a
///   resume. Single-process runs are rank 0.
/// - `kind`: `batch` fingerprints what a step consumed; `order` the
///   sampler's indices it was loaded from, which is all a resume sees of
///   the batches it steps over without loading them ([`PrintKind`]).
const SCHEMA_V7: &str = r#"
CREATE TABLE batches_v7 (
    run_id  TEXT NOT NULL REFERENCES runs (id) ON DELETE CASCADE,
    outer   INTEGER NOT NULL,
    rank    INTEGER NOT NULL DEFAULT 0,
    kind    TEXT NOT NULL DEFAULT 'batch' CHECK (kind IN ('batch', 'order')),
    step    INTEGER NOT NULL,
    digest  TEXT NOT NULL,
    PRIMARY KEY (run_id, outer, rank, kind, step)
) WITHOUT ROWID;
INSERT INTO batches_v7 (run_id, outer, rank, kind, step, digest)
    SELECT run_id, outer, 0, 'batch', step, digest FROM batches;
DROP TABLE batches;
ALTER TABLE batches_v7 RENAME TO batches;
"#;

/// The SQL that computes a `logs` row's checksum from its columns (`t`: the
/// table's alias in the statement).
fn logs_sum(t: &str) -> String {
    format!("hs_row_sum({t}run_id, {t}name, {t}ctx, {t}rep, {t}value, {t}phase, {t}flag)")
}

/// The same for a `replay_logs` row: bound to its replay.
fn staged_sum(t: &str) -> String {
    format!(
        "hs_row_sum({t}run_id, {t}name, {t}ctx, {t}rep, {t}value, 'staged:' || {t}replay_id, NULL)"
    )
}

/// A value row's checksum: BLAKE3 of its fields, each length-prefixed (no
/// two rows encode alike), truncated to 63 bits (an SQLite integer). Run,
/// name, context, occurrence, value, phase and trust flag: everything an
/// answer shows. Row order (`seq`) and times are not covered.
pub fn row_sum(
    run_id: &str,
    name: &str,
    ctx: &str,
    rep: i64,
    value: &str,
    phase: &str,
    flag: Option<&str>,
) -> i64 {
    let mut h = blake3::Hasher::new();
    for field in [run_id, name, ctx, value, phase] {
        h.update(&(field.len() as u64).to_le_bytes());
        h.update(field.as_bytes());
    }
    h.update(&rep.to_le_bytes());
    match flag {
        None => h.update(&[0]),
        Some(f) => h
            .update(&[1])
            .update(&(f.len() as u64).to_le_bytes())
            .update(f.as_bytes()),
    };
    let mut first = [0u8; 8];
    first.copy_from_slice(&h.finalize().as_bytes()[..8]);
    (u64::from_le_bytes(first) >> 1) as i64
}

/// `hs_row_sum(...)` for SQL on this connection: writes store it, checks
/// compare with it.
/// Whether this process may write the database file and its directory
/// (where SQLite puts its journal): `access(2)` answers for the file
/// system too, so a read-only mount is read-only for root as well.
fn writable(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let ok = |p: &Path| {
        let Ok(c) = std::ffi::CString::new(p.as_os_str().as_bytes()) else {
            return false;
        };
        // SAFETY: a NUL-terminated path that lives through the call.
        unsafe { libc::access(c.as_ptr(), libc::W_OK) == 0 }
    };
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    ok(path) && ok(dir)
}

/// `path` for a SQLite `file:` URI: every byte but unreserved ones and `/`
/// percent-encoded (a `?` or `#` in a directory name would end the path).
fn sqlite_uri_path(path: &Path) -> String {
    use std::os::unix::ffi::OsStrExt;
    let mut out = String::new();
    for &b in path.as_os_str().as_bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn register_row_sum(conn: &Connection) -> rusqlite::Result<()> {
    use rusqlite::functions::FunctionFlags;
    conn.create_scalar_function(
        "hs_row_sum",
        7,
        FunctionFlags::SQLITE_UTF8 | FunctionFlags::SQLITE_DETERMINISTIC,
        |ctx| {
            // A damaged row may hold another type where text belongs: its
            // sum is then one no intact row has (-1), never an error here.
            let text = |i: usize| ctx.get::<String>(i).ok();
            let (Some(run), Some(name), Some(c), Some(value), Some(phase)) =
                (text(0), text(1), text(2), text(4), text(5))
            else {
                return Ok(-1i64);
            };
            let Ok(rep) = ctx.get::<i64>(3) else {
                return Ok(-1);
            };
            let flag: Option<String> = ctx.get::<Option<String>>(6).unwrap_or(Some(String::new()));
            Ok(row_sum(
                &run,
                &name,
                &c,
                rep,
                &value,
                &phase,
                flag.as_deref(),
            ))
        },
    )
}

const RUN_COLUMNS: &str =
    "id, script, script_abs, project_root, source_hash, git_commit, git_dirty, \
     args, status, started_ms, ended_ms, host, versions, pid, resume_key, store";

mod batches;
mod iterations;
mod logs;
mod repair;
mod replays;
mod runs;
mod spool;
#[cfg(test)]
mod tests;

pub use batches::{BatchDigest, PrintKind};
pub use iterations::IterationRow;
pub use logs::{ctx_json, Divergence, LogRecord, LogRow, LogValue, Phase};
pub use repair::{repair, Repair, TableRepair};
pub use replays::{ReplayCheck, Trust, INEXACT_RTOL};
pub use runs::{NewRun, RunRow, RunStatus};

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
                return Error::corrupt(
                    path,
                    format!("not a usable log database: {e}; {REPAIR_HINT}"),
                )
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

impl LogDb {
    /// Open (creating it, its parent directory and the schema if needed) the
    /// log database at `path`.
    pub fn open(path: &Path) -> Result<LogDb> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            crate::runs::project::check_home(parent)?;
            crate::durable::create_dir_durable(parent)?;
        }
        let conn = Connection::open(path).db(path)?;
        conn.busy_timeout(BUSY_TIMEOUT).db(path)?;
        register_row_sum(&conn).db(path)?;
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

    /// SQLite's own consistency check (`quick_check`: pages, indexes,
    /// constraints) plus rows whose run is gone. Run before answers that
    /// must not be silently wrong (`show`, `logs`, `replay`); any finding is
    /// a `Corrupt` error naming the database.
    /// Open the database to answer from it: [`LogDb::open`], then
    /// [`LogDb::check_integrity`]. Every read path (the CLI, `hs.dataframe`,
    /// replay, export) opens it this way: answers from a damaged database
    /// would be silently wrong.
    ///
    /// A home this process cannot write (a read-only mount, another user's
    /// project) is read as it is: [`LogDb::open_read_only`].
    pub fn open_checked(path: &Path) -> Result<LogDb> {
        let db = if path.exists() && !writable(path) {
            LogDb::open_read_only(path)?
        } else {
            LogDb::open(path)?
        };
        db.check_integrity()?;
        Ok(db)
    }

    /// Open an existing database to read it only: nothing is created,
    /// migrated or written. SQLite's `immutable` mode, since a reader of a
    /// database in WAL mode needs its index file (`-shm`), which a
    /// read-only directory cannot hold; nothing can write the file there
    /// either. A database of an older schema cannot be upgraded here: an
    /// error says so.
    pub fn open_read_only(path: &Path) -> Result<LogDb> {
        use rusqlite::OpenFlags;
        let flags = OpenFlags::SQLITE_OPEN_READ_ONLY
            | OpenFlags::SQLITE_OPEN_URI
            | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let open = |mode: &str| -> std::result::Result<(Connection, i64), Setup> {
            let uri = format!("file:{}?{mode}", sqlite_uri_path(path));
            let conn = Connection::open_with_flags(&uri, flags)?;
            let version = Self::schema_version(&conn, path)?;
            Ok((conn, version))
        };
        // Read-only first: it sees the write-ahead log a writer left (its
        // index file present). Immutable only where that cannot work (no
        // index file, and none can be made here) and no log is pending:
        // immutable reads ignore the log, and would answer from a file a
        // live writer has not brought up to date.
        let pending_log =
            std::fs::metadata(format!("{}-wal", path.display())).is_ok_and(|m| m.len() > 0);
        let found = open("mode=ro").or_else(|e| {
            if pending_log {
                Err(e)
            } else {
                open("immutable=1")
            }
        });
        let (conn, version) = match found {
            Ok(found) => found,
            Err(Setup::Sql(e)) => return Err(db_err(path, e)),
            Err(Setup::Hindsight(e)) => return Err(e),
        };
        register_row_sum(&conn).db(path)?;
        if version != SCHEMA_VERSION {
            return Err(Error::Database {
                path: path.to_path_buf(),
                detail: format!(
                    "it is read-only here and at schema version {version}; this hindsight reads \
                     {SCHEMA_VERSION}: open it once where it is writable to upgrade it"
                ),
                source: None,
            });
        }
        Ok(LogDb {
            conn,
            path: path.to_path_buf(),
        })
    }

    pub fn check_integrity(&self) -> Result<()> {
        self.check("quick_check")
    }

    /// [`check_integrity`](Self::check_integrity) with SQLite's full
    /// `integrity_check` (index contents too) and every value row's
    /// checksum: `hindsight verify`. (Reads check the sums of the rows they
    /// return; scanning all of them at every open would double its cost:
    /// 0.8 us a row, `cargo run --release -p hindsight-core --example logdb_sums`.)
    pub fn verify(&self) -> Result<()> {
        self.check("integrity_check")?;
        self.check_row_sums()
    }

    fn check(&self, pragma: &str) -> Result<()> {
        let mut st = self
            .conn
            .prepare(&format!("PRAGMA {pragma}(20)"))
            .db(&self.path)?;
        let found: Vec<String> = st
            .query_map([], |r| r.get::<_, String>(0))
            .db(&self.path)?
            .collect::<rusqlite::Result<_>>()
            .db(&self.path)?;
        if found.len() != 1 || found[0] != "ok" {
            return Err(Error::corrupt(
                &self.path,
                format!(
                    "log database fails SQLite's check: {}; {REPAIR_HINT}",
                    found.join("; ")
                ),
            ));
        }
        let orphans: i64 = self
            .conn
            .query_row(
                "SELECT (SELECT count(*) FROM logs WHERE run_id NOT IN (SELECT id FROM runs)) + \
                        (SELECT count(*) FROM iterations WHERE run_id NOT IN (SELECT id FROM runs)) + \
                        (SELECT count(*) FROM batches WHERE run_id NOT IN (SELECT id FROM runs)) + \
                        (SELECT count(*) FROM replay_logs WHERE run_id NOT IN (SELECT id FROM runs))",
                [],
                |r| r.get(0),
            )
            .db(&self.path)?;
        if orphans > 0 {
            return Err(Error::corrupt(
                &self.path,
                format!("{orphans} log or iteration rows belong to no run; {REPAIR_HINT}"),
            ));
        }
        Ok(())
    }

    /// Every value row against its checksum; the first that fails is named.
    pub fn check_row_sums(&self) -> Result<()> {
        for (table, sum) in [("logs", logs_sum("")), ("replay_logs", staged_sum(""))] {
            let sql = format!(
                "SELECT count(*), (SELECT run_id || ': ' || name || ' at ' || ctx FROM {table} \
                 WHERE sum IS NOT {sum} LIMIT 1) FROM {table} WHERE sum IS NOT {sum}"
            );
            let (bad, first): (i64, Option<String>) = self
                .conn
                .query_row(&sql, [], |r| Ok((r.get(0)?, r.get(1)?)))
                .db(&self.path)?;
            if bad > 0 {
                return Err(Error::corrupt(
                    &self.path,
                    format!(
                        "{bad} value row(s) of table {table} fail their checksum (first: {}): \
                         the file was changed outside hindsight or damaged; {REPAIR_HINT}",
                        first.unwrap_or_default()
                    ),
                ));
            }
        }
        Ok(())
    }

    // The user_version ladder is written out here rather than with
    // `rusqlite_migration`: its newest release (2.6.0) is built on rusqlite
    // 0.40, and two rusqlite versions cannot link one bundled SQLite (we are
    // on 0.41). It also takes `&mut Connection` and opens a deferred
    // transaction, where two processes opening one new database need the
    // immediate one below. Revisit when it follows rusqlite.
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
        if found < 3 {
            tx.execute_batch(SCHEMA_V3)?;
        }
        if found < 4 {
            tx.execute_batch(SCHEMA_V4)?;
        }
        if found < 5 {
            tx.execute_batch(SCHEMA_V5)?;
        }
        if found < 6 {
            tx.execute_batch(SCHEMA_V6)?;
        }
        if found < 7 {
            tx.execute_batch(SCHEMA_V7)?;
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
}
