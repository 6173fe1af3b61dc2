//! The `batches` table: a fingerprint of what each training step consumed,
//! written while recording, so that a resume and every replay worker can
//! prove they consume the same data in the same order (or stop, naming the
//! step). The fingerprint is xxh3-128 over the batch's parts in order, each
//! part preceded by its length: a tensor's dtype and shape, then its bytes.

use rusqlite::params;
use xxhash_rust::xxh3::Xxh3;

use super::{to_i64, to_u64, DbResult, LogDb};
use crate::error::Result;

/// Incremental fingerprint of one batch.
#[derive(Clone, Default)]
pub struct BatchDigest(Xxh3);

impl std::fmt::Debug for BatchDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BatchDigest")
    }
}

impl BatchDigest {
    pub fn new() -> Self {
        Self::default()
    }

    /// Add one part (a description or a buffer); parts are delimited, so
    /// `["ab", "c"]` and `["a", "bc"]` differ.
    pub fn part(&mut self, bytes: &[u8]) {
        self.0.update(&(bytes.len() as u64).to_le_bytes());
        self.0.update(bytes);
    }

    /// The fingerprint as 32 hex digits.
    pub fn finish(&self) -> String {
        format!("{:032x}", self.0.digest128())
    }
}

impl LogDb {
    /// Record the fingerprints of steps of outer iteration `outer`:
    /// `(step, digest)`. A step recorded again (a resumed run) replaces it.
    pub fn record_batches(&self, run_id: &str, outer: u64, rows: &[(u64, String)]) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        self.write(|tx| {
            self.require_run(tx, run_id)?;
            let mut st = tx
                .prepare_cached(
                    "INSERT OR REPLACE INTO batches (run_id, outer, step, digest) VALUES (?1, ?2, ?3, ?4)",
                )
                .db(&self.path)?;
            for (step, digest) in rows {
                st.execute(params![run_id, to_i64(outer), to_i64(*step), digest])
                    .db(&self.path)?;
            }
            Ok(())
        })
    }

    /// The recorded fingerprints of outer iteration `outer`'s steps, by step.
    pub fn batch_digests(&self, run_id: &str, outer: u64) -> Result<Vec<(u64, String)>> {
        self.require_run(&self.conn, run_id)?;
        let mut st = self
            .conn
            .prepare_cached(
                "SELECT step, digest FROM batches WHERE run_id = ?1 AND outer = ?2 ORDER BY step",
            )
            .db(&self.path)?;
        let rows = st
            .query_map(params![run_id, to_i64(outer)], |r| {
                Ok((to_u64(r.get::<_, i64>(0)?), r.get::<_, String>(1)?))
            })
            .db(&self.path)?;
        rows.collect::<rusqlite::Result<_>>().db(&self.path)
    }

    /// Whether the run recorded any batch fingerprint (runs recorded before
    /// they existed have none: their replays cannot check the data).
    pub fn has_batch_digests(&self, run_id: &str) -> Result<bool> {
        self.conn
            .prepare_cached("SELECT 1 FROM batches WHERE run_id = ?1 LIMIT 1")
            .and_then(|mut st| st.exists([run_id]))
            .db(&self.path)
    }
}
