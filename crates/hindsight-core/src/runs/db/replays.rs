//! Replay sessions. The values one `hindsight replay` computes are staged in
//! `replay_logs` until the driver has compared every value the recording
//! also logged ([`LogDb::replay_divergences`]); [`LogDb::finish_replay`]
//! then moves them into `logs` with their [`Trust`], or discards them. So a
//! replay that went wrong never shows its values as results, and a less
//! exact replay never overwrites what a more exact one wrote.

use rusqlite::{params, Transaction};

use super::logs::prepare_rows;
use super::{to_i64, DbResult, Divergence, LogDb, LogRow};
use crate::error::{Error, Result};
use crate::runs::dates::now_ms;
use crate::runs::json;

/// Relative difference allowed between recorded and replayed floats in a
/// replay that ran with another thread count than the recording (reductions
/// then round differently: seen 1e-8 to 1e-7 per value after many steps).
pub const INEXACT_RTOL: f64 = 1e-4;

/// How far the values of one replay can be trusted, weakest first: a value
/// is only ever replaced by one of equal or greater trust.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Trust {
    /// Kept on request (`--allow-divergence`) although recorded values differed.
    Diverged,
    /// Computed with another thread count: equal to the recording within
    /// [`INEXACT_RTOL`], maybe not in the last bits.
    Inexact,
    /// Computed as recorded; every value the recording also logged is equal.
    Exact,
}

impl Trust {
    /// The `logs.flag` text (None for exact values).
    pub fn flag(self) -> Option<&'static str> {
        match self {
            Trust::Exact => None,
            Trust::Inexact => Some("inexact"),
            Trust::Diverged => Some("diverged"),
        }
    }

    /// The trust of a stored flag; an unknown flag is trusted least.
    pub fn of_flag(flag: Option<&str>) -> Trust {
        match flag {
            None => Trust::Exact,
            Some("inexact") => Trust::Inexact,
            Some(_) => Trust::Diverged,
        }
    }

    /// The name a user passes and sees: exact, inexact, diverged.
    pub fn as_str(self) -> &'static str {
        self.flag().unwrap_or("exact")
    }

    /// Parse [`Trust::as_str`].
    pub fn parse(text: &str) -> Result<Trust> {
        match text {
            "exact" => Ok(Trust::Exact),
            "inexact" => Ok(Trust::Inexact),
            "diverged" => Ok(Trust::Diverged),
            _ => Err(Error::invalid(
                "replay trust",
                format!("'{text}' is not one of exact, inexact, diverged"),
            )),
        }
    }
}

/// What a check of a replay's staged values found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayCheck {
    /// Values the recording logged that the replay computed differently, in
    /// record order (the first divergence first).
    pub divergences: Vec<Divergence>,
    /// The position of the newest staged value checked: pass it as `after`
    /// to check only what is written later.
    pub last_seq: i64,
}

/// One value a replay worker staged (`replay_logs`).
struct StagedValue {
    name: String,
    ctx: String,
    rep: u32,
    value: String,
    created_ms: i64,
}

impl LogDb {
    /// Start a replay of `run_id`: its id, for the workers' plans.
    /// `exact`: it runs as the recording did (same thread count).
    pub fn begin_replay(&self, run_id: &str, exact: bool) -> Result<i64> {
        self.write(|tx| {
            self.require_run(tx, run_id)?;
            tx.execute(
                "INSERT INTO replays (run_id, exact, status, started_ms) VALUES (?1, ?2, 'running', ?3)",
                params![run_id, exact, to_i64(now_ms())],
            )
            .db(&self.path)?;
            Ok(tx.last_insert_rowid())
        })
    }

    /// Stage values a worker of replay `replay_id` computed. A value written
    /// again at the same name, context and occurrence replaces the staged one.
    pub fn append_replay_logs(&self, replay_id: i64, run_id: &str, rows: &[LogRow]) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let prepared = prepare_rows(run_id, rows)?;
        let created = to_i64(now_ms());
        self.write(|tx| {
            self.require_run(tx, run_id)?;
            let mut seq: i64 = tx
                .prepare_cached(
                    "SELECT COALESCE(MAX(seq), 0) FROM replay_logs WHERE replay_id = ?1",
                )
                .and_then(|mut st| st.query_row([replay_id], |r| r.get(0)))
                .db(&self.path)?;
            let mut st = tx
                .prepare_cached(
                    "INSERT INTO replay_logs (replay_id, run_id, name, ctx, rep, value, seq, created_ms, sum) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, hs_row_sum(?2, ?3, ?4, ?5, ?6, 'staged:' || ?1, NULL)) \
                     ON CONFLICT (replay_id, name, ctx, rep) DO UPDATE SET \
                     value = excluded.value, seq = excluded.seq, created_ms = excluded.created_ms, \
                     sum = excluded.sum",
                )
                .db(&self.path)?;
            for (name, ctx, rep, value) in &prepared {
                seq += 1;
                st.execute(params![replay_id, run_id, name, ctx, rep, value, seq, created])
                    .db(&self.path)?;
            }
            Ok(())
        })
    }

    fn replay_row(&self, replay_id: i64) -> Result<(String, bool)> {
        self.conn
            .query_row(
                "SELECT run_id, exact FROM replays WHERE id = ?1",
                [replay_id],
                |r| Ok((r.get::<_, String>(0)?, r.get::<_, bool>(1)?)),
            )
            .map_err(|e| match e {
                rusqlite::Error::QueryReturnedNoRows => {
                    self.not_found("replay", &replay_id.to_string())
                }
                e => super::db_err(&self.path, e),
            })
    }

    /// Values staged by replay `replay_id` after position `after` that differ
    /// from what the recording logged at the same name, context and
    /// occurrence: exactly, or within [`INEXACT_RTOL`] for an inexact replay.
    pub fn replay_divergences(&self, replay_id: i64, after: i64) -> Result<ReplayCheck> {
        let (run_id, exact) = self.replay_row(replay_id)?;
        let rtol = if exact { 0.0 } else { INEXACT_RTOL };
        let mut st = self
            .conn
            .prepare_cached(&format!(
                "SELECT r.name, r.ctx, r.value, p.value, r.seq, r.rep, \
                        r.sum IS {} AND p.sum IS {} FROM replay_logs p \
                 JOIN logs r ON r.run_id = p.run_id AND r.name = p.name AND r.ctx = p.ctx \
                      AND r.rep = p.rep AND r.phase = 'record' \
                 WHERE p.replay_id = ?1 AND p.seq > ?2 ORDER BY r.seq",
                super::logs_sum("r."),
                super::staged_sum("p.")
            ))
            .db(&self.path)?;
        let rows = st
            .query_map(params![replay_id, after], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, String>(3)?,
                    r.get::<_, i64>(4)?,
                    r.get::<_, u32>(5)?,
                    r.get::<_, bool>(6)?,
                ))
            })
            .db(&self.path)?;
        let mut divergences = Vec::new();
        for row in rows {
            let (name, ctx_text, record_value, replay_value, record_seq, rep, intact) =
                row.db(&self.path)?;
            if !intact {
                return Err(self.bad_sum(&run_id, &name, &ctx_text));
            }
            if json::values_close(&record_value, &replay_value, rtol) {
                continue;
            }
            divergences.push(Divergence {
                ctx: self.decode_ctx(&run_id, &name, &ctx_text)?,
                name,
                ctx_json: ctx_text,
                rep,
                record_value,
                replay_value,
                record_seq,
            });
        }
        let last_seq: i64 = self
            .conn
            .query_row(
                "SELECT COALESCE(MAX(seq), 0) FROM replay_logs WHERE replay_id = ?1",
                [replay_id],
                |r| r.get(0),
            )
            .db(&self.path)?;
        Ok(ReplayCheck {
            divergences,
            last_seq: last_seq.max(after),
        })
    }

    /// End replay `replay_id`: with `keep`, its staged values join the run's
    /// values (phase replay) with that trust, each replacing an earlier
    /// replay's value only if that one is not more trusted; without, they
    /// are discarded. Returns the number of values that joined.
    pub fn finish_replay(&self, replay_id: i64, keep: Option<Trust>) -> Result<usize> {
        let (run_id, _) = self.replay_row(replay_id)?;
        let finished = to_i64(now_ms());
        self.write(|tx| {
            let mut kept = 0;
            if let Some(trust) = keep {
                // Each value keeps the time its worker computed it.
                let staged = self.staged_values(tx, replay_id, &run_id)?;
                let mut seq: i64 = tx
                    .prepare_cached("SELECT COALESCE(MAX(seq), 0) FROM logs WHERE run_id = ?1")
                    .and_then(|mut st| st.query_row([&run_id], |r| r.get(0)))
                    .db(&self.path)?;
                let mut existing = tx
                    .prepare_cached(
                        "SELECT flag FROM logs WHERE run_id = ?1 AND name = ?2 AND ctx = ?3 \
                         AND rep = ?4 AND phase = 'replay'",
                    )
                    .db(&self.path)?;
                let mut upsert = tx
                    .prepare_cached(
                        "INSERT INTO logs (run_id, name, ctx, rep, value, phase, seq, created_ms, flag, sum) \
                         VALUES (?1, ?2, ?3, ?4, ?5, 'replay', ?6, ?7, ?8, \
                                 hs_row_sum(?1, ?2, ?3, ?4, ?5, 'replay', ?8)) \
                         ON CONFLICT (run_id, name, ctx, rep, phase) DO UPDATE SET \
                         value = excluded.value, seq = excluded.seq, \
                         created_ms = excluded.created_ms, flag = excluded.flag, sum = excluded.sum",
                    )
                    .db(&self.path)?;
                for StagedValue {
                    name,
                    ctx,
                    rep,
                    value,
                    created_ms: created,
                } in &staged
                {
                    let before: Option<Option<String>> = existing
                        .query_row(params![run_id, name, ctx, rep], |r| r.get(0))
                        .map(Some)
                        .or_else(|e| match e {
                            rusqlite::Error::QueryReturnedNoRows => Ok(None),
                            e => Err(e),
                        })
                        .db(&self.path)?;
                    if matches!(&before, Some(flag) if Trust::of_flag(flag.as_deref()) > trust) {
                        continue; // an earlier replay computed it more exactly
                    }
                    seq += 1;
                    upsert
                        .execute(params![run_id, name, ctx, rep, value, seq, created, trust.flag()])
                        .db(&self.path)?;
                    kept += 1;
                }
            }
            tx.execute("DELETE FROM replay_logs WHERE replay_id = ?1", [replay_id])
                .db(&self.path)?;
            let status = keep.map_or("discarded", Trust::as_str);
            tx.execute(
                "UPDATE replays SET status = ?2, ended_ms = ?3 WHERE id = ?1",
                params![replay_id, status, finished],
            )
            .db(&self.path)?;
            Ok(kept)
        })
    }

    /// The values replay `replay_id` staged, in the order written, each
    /// checked against its checksum.
    fn staged_values(
        &self,
        tx: &Transaction<'_>,
        replay_id: i64,
        run_id: &str,
    ) -> Result<Vec<StagedValue>> {
        let mut st = tx
            .prepare_cached(&format!(
                "SELECT name, ctx, rep, value, created_ms, sum IS {} FROM replay_logs \
                 WHERE replay_id = ?1 ORDER BY seq",
                super::staged_sum("")
            ))
            .db(&self.path)?;
        let rows = st
            .query_map([replay_id], |r| {
                Ok((
                    StagedValue {
                        name: r.get(0)?,
                        ctx: r.get(1)?,
                        rep: r.get(2)?,
                        value: r.get(3)?,
                        created_ms: r.get(4)?,
                    },
                    r.get::<_, bool>(5)?,
                ))
            })
            .db(&self.path)?;
        let mut out = Vec::new();
        for row in rows {
            let (v, intact) = row.db(&self.path)?;
            if !intact {
                return Err(self.bad_sum(run_id, &v.name, &v.ctx));
            }
            out.push(v);
        }
        Ok(out)
    }

    /// The values staged by replay `replay_id` (a Slurm task's own database:
    /// what [`LogDb::import_replay`] merges).
    pub(super) fn staged_rows(&self, replay_id: i64, run_id: &str) -> Result<Vec<LogRow>> {
        let mut st = self
            .conn
            .prepare_cached(&format!(
                "SELECT name, ctx, rep, value, sum IS {} FROM replay_logs WHERE replay_id = ?1 ORDER BY seq",
                super::staged_sum("")
            ))
            .db(&self.path)?;
        let rows = st
            .query_map([replay_id], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, u32>(2)?,
                    r.get::<_, String>(3)?,
                    r.get::<_, bool>(4)?,
                ))
            })
            .db(&self.path)?;
        let mut out = Vec::new();
        for row in rows {
            let (name, ctx, rep, value_json, intact) = row.db(&self.path)?;
            if !intact {
                return Err(self.bad_sum(run_id, &name, &ctx));
            }
            out.push(LogRow {
                ctx: self.decode_ctx(run_id, &name, &ctx)?,
                name,
                rep,
                value_json,
            });
        }
        Ok(out)
    }
}
