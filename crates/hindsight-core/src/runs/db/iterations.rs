//! The `iterations` table: how long each loop iteration took and which
//! checkpoint it left behind.

use rusqlite::params;

use super::{to_i64, to_u64, DbResult, LogDb};
use crate::error::{Error, Result};

/// Timing (and checkpoint) of one loop iteration.
#[derive(Debug, Clone, PartialEq)]
pub struct IterationRow {
    pub loop_name: String,
    pub idx: u64,
    /// The integer the loop iterated over at this position, if it was one
    /// (1 for position 0 of `range(1, N)`).
    pub value: Option<i64>,
    /// Compute seconds of the iteration.
    pub seconds: f64,
    /// Name of the checkpoint saved at its end, if any.
    pub checkpoint: Option<String>,
    pub materialize_seconds: Option<f64>,
    pub restore_seconds: Option<f64>,
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

impl LogDb {
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
                     (run_id, loop_name, idx, seconds, checkpoint, materialize_seconds, restore_seconds, value) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
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
                    row.value,
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

    /// The outer loops a run recorded iterations of (normally one: the
    /// first `hs.loop` entered, wherever in the script it is), in the order
    /// they were first recorded.
    pub fn outer_loops(&self, run_id: &str) -> Result<Vec<String>> {
        self.require_run(&self.conn, run_id)?;
        let mut st = self
            .conn
            .prepare_cached(
                "SELECT loop_name FROM iterations WHERE run_id = ?1 \
                 GROUP BY loop_name ORDER BY MIN(rowid)",
            )
            .db(&self.path)?;
        let rows = st.query_map([run_id], |r| r.get(0)).db(&self.path)?;
        rows.collect::<rusqlite::Result<Vec<String>>>()
            .db(&self.path)
    }

    /// A run's recorded iterations of one loop, by index.
    pub fn iterations(&self, run_id: &str, loop_name: &str) -> Result<Vec<IterationRow>> {
        self.require_run(&self.conn, run_id)?;
        let mut st = self
            .conn
            .prepare_cached(
                "SELECT loop_name, idx, seconds, checkpoint, materialize_seconds, restore_seconds, value \
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
                    value: r.get(6)?,
                })
            })
            .db(&self.path)?;
        rows.collect::<rusqlite::Result<Vec<_>>>().db(&self.path)
    }
}
