//! The `logs` table: values logged per loop context, in the record and the
//! replay phase, and the divergences between the two.

use std::fmt;
use std::str::FromStr;

use rusqlite::params;

use super::{to_i64, to_u64, DbResult, LogDb};
use crate::error::{Error, Result};
use crate::runs::dates::now_ms;
use crate::runs::json;

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

/// One value to log: `name` at loop context `ctx` (outermost loop first,
/// e.g. `[("epoch", 3), ("step", 17)]`; empty at top level); `rep` counts
/// earlier values of this name in this context (0 for the first).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRow {
    pub name: String,
    pub ctx: Vec<(String, i64)>,
    pub rep: u32,
    pub value_json: String,
}

/// A stored log value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRecord {
    pub name: String,
    pub ctx: Vec<(String, i64)>,
    /// The context as stored: canonical JSON, e.g. `{"epoch":3,"step":17}`.
    pub ctx_json: String,
    /// The occurrence of `name` within `ctx` (see [`LogRow::rep`]).
    pub rep: u32,
    pub value_json: String,
    pub phase: Phase,
    /// Position in the run's write order (both phases share one sequence).
    pub seq: i64,
    pub created_ms: u64,
    /// A replayed value's trust (see [`Trust`](super::Trust)): None where exact.
    pub flag: Option<String>,
}

/// One name at one loop context (and occurrence), with what each phase wrote there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogValue {
    pub name: String,
    pub ctx: Vec<(String, i64)>,
    pub ctx_json: String,
    pub rep: u32,
    /// JSON text written by the recorded run, if it logged this.
    pub recorded: Option<String>,
    /// JSON text written by a replay, if one logged this.
    pub replayed: Option<String>,
    /// Why the replayed value is not exact (`inexact`, `diverged`); None
    /// where it is, or where no replay logged this.
    pub replay_flag: Option<String>,
}

impl LogValue {
    /// The value to show: the recorded one where the run logged it (it is
    /// what happened in training; a replay that disagrees is reported as a
    /// divergence), else the one a replay added.
    pub fn value(&self) -> &str {
        self.recorded
            .as_deref()
            .or(self.replayed.as_deref())
            .unwrap_or("null")
    }

    /// Both phases logged it and the values differ (as JSON values).
    pub fn diverged(&self) -> bool {
        match (&self.recorded, &self.replayed) {
            (Some(a), Some(b)) => !json::values_equal(a, b),
            _ => false,
        }
    }
}

/// A value logged in both phases at the same context that differs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Divergence {
    pub name: String,
    pub ctx: Vec<(String, i64)>,
    pub ctx_json: String,
    pub rep: u32,
    pub record_value: String,
    pub replay_value: String,
    /// `seq` of the record-phase row (divergences come in this order).
    pub record_seq: i64,
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

/// Rows checked (name, loop names, JSON value) and their context encoded:
/// (name, context, occurrence, value).
pub(super) fn prepare_rows<'a>(
    run_id: &str,
    rows: &'a [LogRow],
) -> Result<Vec<(&'a str, String, u32, &'a str)>> {
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
        prepared.push((row.name.as_str(), ctx_json(&row.ctx), row.rep, value));
    }
    Ok(prepared)
}

pub(super) fn parse_ctx(text: &str) -> Option<Vec<(String, i64)>> {
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

impl LogDb {
    // ---------------------------------------------------------------- logs

    /// Append log values of a run in one transaction. A value logged again
    /// with the same name, context and occurrence in the same phase replaces
    /// the old one (and moves to the end of the sequence), so re-executed
    /// iterations do not duplicate rows.
    pub fn append_logs(&self, run_id: &str, phase: Phase, rows: &[LogRow]) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        let prepared = prepare_rows(run_id, rows)?;
        let created = to_i64(now_ms());
        self.write(|tx| {
            self.require_run(tx, run_id)?;
            let mut seq: i64 = tx
                .prepare_cached("SELECT COALESCE(MAX(seq), 0) FROM logs WHERE run_id = ?1")
                .and_then(|mut st| st.query_row([run_id], |r| r.get(0)))
                .db(&self.path)?;
            let mut st = tx
                .prepare_cached(
                    "INSERT INTO logs (run_id, name, ctx, rep, value, phase, seq, created_ms, sum) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, hs_row_sum(?1, ?2, ?3, ?4, ?5, ?6, NULL)) \
                     ON CONFLICT (run_id, name, ctx, rep, phase) DO UPDATE SET \
                     value = excluded.value, seq = excluded.seq, created_ms = excluded.created_ms, \
                     sum = hs_row_sum(run_id, name, ctx, rep, excluded.value, phase, flag)",
                )
                .db(&self.path)?;
            for (name, ctx, rep, value) in &prepared {
                seq += 1;
                st.execute(params![
                    run_id,
                    name,
                    ctx,
                    rep,
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
            .prepare_cached(&format!(
                "SELECT name, ctx, value, phase, seq, created_ms, rep, flag, sum IS {} FROM logs \
                 WHERE run_id = ?1 AND (?2 IS NULL OR name IN (SELECT value FROM json_each(?2))) \
                 ORDER BY seq",
                super::logs_sum("")
            ))
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
                    r.get::<_, u32>(6)?,
                    r.get::<_, Option<String>>(7)?,
                    r.get::<_, bool>(8)?,
                ))
            })
            .db(&self.path)?;
        let mut out = Vec::new();
        for row in rows {
            let (name, ctx_text, value_json, phase, seq, created, rep, flag, intact) =
                row.db(&self.path)?;
            if !intact {
                return Err(self.bad_sum(run_id, &name, &ctx_text));
            }
            out.push(LogRecord {
                ctx: self.decode_ctx(run_id, &name, &ctx_text)?,
                phase: phase
                    .parse()
                    .map_err(|_| self.bad_row(run_id, &name, "phase"))?,
                name,
                ctx_json: ctx_text,
                rep,
                value_json,
                seq,
                created_ms: to_u64(created),
                flag,
            });
        }
        Ok(out)
    }

    /// The values of `names` (all when empty) per loop context and
    /// occurrence, both phases merged: what `hindsight logs` and
    /// `hs.dataframe` show. In the order each (name, context, occurrence)
    /// was first written.
    pub fn values(&self, run_id: &str, names: &[String]) -> Result<Vec<LogValue>> {
        let mut out: Vec<LogValue> = Vec::new();
        let mut at: std::collections::HashMap<(String, String, u32), usize> = Default::default();
        for rec in self.logs(run_id, names)? {
            let i = *at
                .entry((rec.name.clone(), rec.ctx_json.clone(), rec.rep))
                .or_insert_with(|| {
                    out.push(LogValue {
                        name: rec.name.clone(),
                        ctx: rec.ctx.clone(),
                        ctx_json: rec.ctx_json.clone(),
                        rep: rec.rep,
                        recorded: None,
                        replayed: None,
                        replay_flag: None,
                    });
                    out.len() - 1
                });
            match rec.phase {
                Phase::Record => out[i].recorded = Some(rec.value_json),
                Phase::Replay => {
                    out[i].replayed = Some(rec.value_json);
                    out[i].replay_flag = rec.flag;
                }
            }
        }
        // Occurrences of one name in one context in their own order, even
        // where a re-executed iteration rewrote some of them later.
        let mut first: std::collections::HashMap<(&str, &str), usize> = Default::default();
        for (i, v) in out.iter().enumerate() {
            first.entry((&v.name, &v.ctx_json)).or_insert(i);
        }
        let mut order: Vec<(usize, u32, usize)> = out
            .iter()
            .enumerate()
            .map(|(i, v)| (first[&(v.name.as_str(), v.ctx_json.as_str())], v.rep, i))
            .collect();
        order.sort_unstable();
        let mut slots: Vec<Option<LogValue>> = out.into_iter().map(Some).collect();
        Ok(order
            .into_iter()
            .filter_map(|(_, _, i)| slots[i].take())
            .collect())
    }

    /// A value row that fails its checksum ([`super::row_sum`]).
    pub(super) fn bad_sum(&self, run_id: &str, name: &str, ctx: &str) -> Error {
        Error::corrupt(
            &self.path,
            format!(
                "log '{name}' at {ctx} of run {run_id} fails its checksum: the file was changed \
                 outside hindsight or damaged; {}",
                super::REPAIR_HINT
            ),
        )
    }

    fn bad_row(&self, run_id: &str, name: &str, what: &str) -> Error {
        Error::corrupt(
            &self.path,
            format!("log '{name}' of run {run_id} has an invalid {what}"),
        )
    }

    pub(super) fn decode_ctx(
        &self,
        run_id: &str,
        name: &str,
        text: &str,
    ) -> Result<Vec<(String, i64)>> {
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

    /// What `runs` logged (in order of first appearance), or
    /// [`Error::NotLogged`] naming the `names` none of them logged: one rule
    /// for `hindsight logs` and `hs.dataframe`, so a typo is never an empty
    /// table. A name some of the runs logged is fine (runs are compared).
    pub fn require_logged(&self, runs: &[String], names: &[String]) -> Result<Vec<String>> {
        let mut logged: Vec<String> = Vec::new();
        for run in runs {
            for name in self.log_names(run)? {
                if !logged.contains(&name) {
                    logged.push(name);
                }
            }
        }
        let mut unknown: Vec<String> = Vec::new();
        for name in names {
            if !logged.contains(name) && !unknown.contains(name) {
                unknown.push(name.clone());
            }
        }
        if unknown.is_empty() {
            Ok(logged)
        } else {
            Err(Error::NotLogged {
                runs: runs.to_vec(),
                names: unknown,
                logged,
            })
        }
    }

    /// Values logged in both phases at the same name and context whose
    /// replay value differs from the recorded one (see
    /// [`json::values_equal`]), in record order: the first divergence first.
    pub fn divergences(&self, run_id: &str) -> Result<Vec<Divergence>> {
        self.divergences_since(run_id, None)
    }

    /// The position of the run's latest log row (0 when it has none): a
    /// replay notes it before it starts, to judge only what it writes.
    pub fn last_seq(&self, run_id: &str) -> Result<i64> {
        self.require_run(&self.conn, run_id)?;
        self.conn
            .query_row(
                "SELECT COALESCE(MAX(seq), 0) FROM logs WHERE run_id = ?1",
                [run_id],
                |r| r.get(0),
            )
            .db(&self.path)
    }

    /// Like [`LogDb::divergences`], but only replayed values written after
    /// position `after` ([`LogDb::last_seq`]): what one replay wrote, not
    /// what an earlier (maybe failed or forced) replay left behind.
    pub fn divergences_since(&self, run_id: &str, after: Option<i64>) -> Result<Vec<Divergence>> {
        self.require_run(&self.conn, run_id)?;
        let mut st = self
            .conn
            .prepare_cached(&format!(
                "SELECT r.name, r.ctx, r.value, p.value, r.seq, r.rep, \
                        r.sum IS {} AND p.sum IS {} FROM logs r \
                 JOIN logs p ON p.run_id = r.run_id AND p.name = r.name AND p.ctx = r.ctx \
                      AND p.rep = r.rep AND p.phase = 'replay' AND (?2 IS NULL OR p.seq > ?2) \
                 WHERE r.run_id = ?1 AND r.phase = 'record' ORDER BY r.seq",
                super::logs_sum("r."),
                super::logs_sum("p.")
            ))
            .db(&self.path)?;
        let rows = st
            .query_map(params![run_id, after], |r| {
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
        let mut out = Vec::new();
        for row in rows {
            let (name, ctx_text, record_value, replay_value, record_seq, rep, intact) =
                row.db(&self.path)?;
            if !intact {
                return Err(self.bad_sum(run_id, &name, &ctx_text));
            }
            if json::values_equal(&record_value, &replay_value) {
                continue;
            }
            out.push(Divergence {
                ctx: self.decode_ctx(run_id, &name, &ctx_text)?,
                name,
                ctx_json: ctx_text,
                rep,
                record_value,
                replay_value,
                record_seq,
            });
        }
        Ok(out)
    }
}
