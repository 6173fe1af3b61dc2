//! A replay worker's own database, for workers that cannot share the
//! project's `logs.db` (a Slurm task on another node: SQLite's locks and WAL
//! do not work over a network file system). The driver exports the run into
//! a fresh file, the worker writes its values there, and the driver merges
//! them back, through the same rules as a local worker's writes.

use std::path::Path;

use rusqlite::params;

use super::{to_i64, DbResult, LogDb, PrintKind, RUN_COLUMNS};
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
        // The replays under way, so the worker can judge its staged values.
        let running: Vec<(i64, bool, i64)> = {
            let mut st = self
                .conn
                .prepare(
                    "SELECT id, exact, started_ms FROM replays WHERE run_id = ?1 AND status = 'running'",
                )
                .db(&self.path)?;
            let rows = st
                .query_map([run_id], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
                .db(&self.path)?;
            rows.collect::<rusqlite::Result<_>>().db(&self.path)?
        };
        spool.write(|tx| {
            for (id, exact, started) in &running {
                tx.execute(
                    "INSERT INTO replays (id, run_id, exact, status, started_ms) VALUES (?1, ?2, ?3, 'running', ?4)",
                    params![id, run_id, exact, started],
                )
                .db(&spool.path)?;
            }
            Ok(())
        })?;
        let ranks = self.batch_ranks(run_id)?;
        for name in self.outer_loops(run_id)? {
            let rows = self.iterations(run_id, &name)?;
            spool.record_iterations(run_id, &rows)?;
            // The worker checks the data it consumes against these.
            for it in &rows {
                for &rank in &ranks {
                    for kind in [PrintKind::Batch, PrintKind::Order] {
                        let digests = self.batch_digests(run_id, it.idx, rank, kind)?;
                        spool.record_batches(run_id, it.idx, rank, kind, &digests)?;
                    }
                }
            }
        }
        Ok(())
    }

    /// Merge what a replay worker wrote into `src` (made by [`export_run`](Self::export_run))
    /// into this database: the values it staged for replay `replay_id`, in
    /// the order it wrote them (still staged: the driver judges them with
    /// the other tasks'), and the restore times it measured. Returns the
    /// number of values merged.
    pub fn import_replay(&self, run_id: &str, src: &Path, replay_id: i64) -> Result<usize> {
        if !src.is_file() {
            return Err(Error::NotFound {
                what: "replay database",
                name: src.display().to_string(),
                location: self.path.display().to_string(),
            });
        }
        let spool = LogDb::open(src)?;
        let rows = spool.staged_rows(replay_id, run_id)?;
        self.append_replay_logs(replay_id, run_id, &rows)?;
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
