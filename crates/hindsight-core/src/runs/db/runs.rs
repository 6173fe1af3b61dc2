//! The `runs` and `sources` tables: recorded runs and their source snapshots.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::str::FromStr;

use rusqlite::{params, OptionalExtension, Row};

use super::{to_i64, to_u64, DbResult, LogDb, RUN_COLUMNS};
use crate::error::{Error, Result};
use crate::runs::dates::now_ms;
use crate::runs::ids::{new_run_id, source_hash};
use crate::runs::json::check_json;

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
        // The CHECK constraint keeps other values out; a row that breaks it
        // anyway (an edited file) is reported, not read as some status.
        status: status.parse().map_err(|e: Error| {
            rusqlite::Error::FromSqlConversionFailure(8, rusqlite::types::Type::Text, Box::new(e))
        })?,
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

    /// The newest run.
    pub fn latest_run(&self) -> Result<Option<RunRow>> {
        Ok(self.runs(Some(1))?.into_iter().next())
    }

    /// The runs of the script now at `script_abs` in the project rooted at
    /// `root_now`, newest first, their paths where the project is now
    /// ([`RunRow::is_of`], [`RunRow::relocated`]).
    pub fn runs_of(&self, script_abs: &Path, root_now: &Path) -> Result<Vec<RunRow>> {
        Ok(self
            .runs(None)?
            .into_iter()
            .filter(|r| r.is_of(script_abs, root_now))
            .map(|r| r.relocated(root_now))
            .collect())
    }

    /// The newest run with this resume key whose status is `interrupted` or
    /// `running` (a run killed without a chance to say so stays `running`).
    /// Delete a run and (by cascade) its logs and iterations; source
    /// snapshots no run uses any more go too. NotFound if there is no such run.
    pub fn delete_run(&self, run_id: &str) -> Result<()> {
        self.write(|tx| {
            let n = tx
                .execute("DELETE FROM runs WHERE id = ?1", [run_id])
                .db(&self.path)?;
            if n == 0 {
                return Err(self.not_found("run", run_id));
            }
            tx.execute(
                "DELETE FROM sources WHERE hash NOT IN (SELECT source_hash FROM runs)",
                [],
            )
            .db(&self.path)?;
            Ok(())
        })
    }

    /// `include_failed`: also a run that failed (for a restart by `hindsight run`).
    pub fn find_resumable(&self, resume_key: &str, include_failed: bool) -> Result<Option<RunRow>> {
        let statuses = if include_failed {
            "'interrupted', 'running', 'failed'"
        } else {
            "'interrupted', 'running'"
        };
        let rows = self.query_runs(
            &format!(
                "SELECT {RUN_COLUMNS} FROM runs WHERE resume_key = ?1 \
                 AND status IN ({statuses}) \
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
}
