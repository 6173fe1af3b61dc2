//! A replay worker's own database, for workers that cannot share the
//! project's `logs.db` (a Slurm task on another node: SQLite's locks and WAL
//! do not work over a network file system). The driver exports the run into
//! a fresh file, the worker writes its values there, and the driver merges
//! them back, through the same rules as a local worker's writes.

use std::path::Path;

use rusqlite::params;

use super::{to_i64, DbResult, LogDb, LogRow, Phase, RUN_COLUMNS};
use crate::error::{Error, Result};

impl LogDb {
    /// Create the database at `dest` (which must not exist) holding `run_id`'s
    /// row and recorded iterations: what a replay worker reads.
    pub fn export_run(&self, run_id: &str, dest: &Path) -> Result<()> {
        let run = self.run(run_id)?;
        if dest.exists() {
            return Err(Error::invalid(
                format!("replay database {}", dest.display()),
                "already exists (a worker's database is created fresh for each replay)",
            ));
        }
        let spool = LogDb::open(dest)?;
        spool.write(|tx| {
            tx.execute(
                &format!(
                    "INSERT INTO runs ({RUN_COLUMNS}) VALUES \
                     (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16)"
                ),
                params![
                    run.id,
                    run.script,
                    run.script_abs,
                    run.project_root,
                    run.source_hash,
                    run.git_commit,
                    run.git_dirty.map(i64::from),
                    run.args_json,
                    run.status.as_str(),
                    to_i64(run.started_ms),
                    run.ended_ms.map(to_i64),
                    run.host,
                    run.versions_json,
                    i64::from(run.pid),
                    run.resume_key,
                    run.store,
                ],
            )
            .db(&spool.path)
        })?;
        for name in self.outer_loops(run_id)? {
            spool.record_iterations(run_id, &self.iterations(run_id, &name)?)?;
        }
        Ok(())
    }

    /// Merge what a replay worker wrote into `src` (made by [`export_run`](Self::export_run))
    /// into this database: its replay values, in the order it wrote them, and
    /// the restore times it measured. Returns the number of values merged.
    pub fn import_replay(&self, run_id: &str, src: &Path) -> Result<usize> {
        if !src.is_file() {
            return Err(Error::NotFound {
                what: "replay database",
                name: src.display().to_string(),
                location: self.path.display().to_string(),
            });
        }
        let spool = LogDb::open(src)?;
        let rows: Vec<LogRow> = spool
            .logs(run_id, &[])?
            .into_iter()
            .filter(|r| r.phase == Phase::Replay)
            .map(|r| LogRow {
                name: r.name,
                ctx: r.ctx,
                rep: r.rep,
                value_json: r.value_json,
            })
            .collect();
        self.append_logs(run_id, Phase::Replay, &rows)?;
        for name in spool.outer_loops(run_id)? {
            for it in spool.iterations(run_id, &name)? {
                if let Some(seconds) = it.restore_seconds {
                    self.set_restore_seconds(run_id, &name, it.idx, seconds)?;
                }
            }
        }
        Ok(rows.len())
    }
}
