//! The `batches` table: a fingerprint of what each training step consumed,
//! written while recording, so that a resume and every replay worker can
//! prove they consume the same data in the same order (or stop, naming the
//! step). Each rank of a job keeps its own: its batches differ from the
//! others' (a `DistributedSampler`'s share). Beside what a step consumed, a
//! loader that a resume steps over by its sampler's indices alone (loading
//! nothing) has those indices fingerprinted: the resume compares them. The
//! fingerprint is xxh3-128 over the batch's parts in order, each
//! part preceded by its length: a tensor's dtype and shape, then its bytes.

use rusqlite::params;
use twox_hash::XxHash3_128 as Xxh3;

use super::{to_i64, to_u64, DbResult, LogDb};
use crate::error::Result;

/// What a fingerprint is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PrintKind {
    /// What a training step consumed: its batch, loaded.
    Batch,
    /// The sampler's indices the batch was loaded from.
    Order,
}

impl PrintKind {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Batch => "batch",
            Self::Order => "order",
        }
    }

    /// `batch` or `order`; another word is refused, naming it.
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "batch" => Ok(Self::Batch),
            "order" => Ok(Self::Order),
            _ => Err(crate::error::Error::invalid(
                "kind",
                format!("{s:?} is not a fingerprint kind (batch, order)"),
            )),
        }
    }
}

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
        self.0.write(&(bytes.len() as u64).to_le_bytes());
        self.0.write(bytes);
    }

    /// Append one part to `buf`, framed as [`part`](Self::part) frames it.
    pub fn frame(buf: &mut Vec<u8>, bytes: &[u8]) {
        buf.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        buf.extend_from_slice(bytes);
    }

    /// Parts framed into one buffer ([`frame`](Self::frame)), hashed in one
    /// go: the same fingerprint as adding them one by one, for fewer calls.
    pub fn framed(&mut self, framed: &[u8]) {
        self.0.write(framed);
    }

    /// The fingerprint as 32 hex digits.
    pub fn finish(&self) -> String {
        format!("{:032x}", self.0.finish_128())
    }
}

impl LogDb {
    /// Record the fingerprints of rank `rank`'s steps of outer iteration
    /// `outer`: `(step, digest)`. A step recorded again (a resumed run)
    /// replaces it.
    pub fn record_batches(
        &self,
        run_id: &str,
        outer: u64,
        rank: u32,
        kind: PrintKind,
        rows: &[(u64, String)],
    ) -> Result<()> {
        if rows.is_empty() {
            return Ok(());
        }
        self.write(|tx| {
            self.require_run(tx, run_id)?;
            let mut st = tx
                .prepare_cached(
                    "INSERT OR REPLACE INTO batches (run_id, outer, rank, kind, step, digest) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6)",
                )
                .db(&self.path)?;
            for (step, digest) in rows {
                st.execute(params![
                    run_id,
                    to_i64(outer),
                    rank,
                    kind.as_str(),
                    to_i64(*step),
                    digest
                ])
                .db(&self.path)?;
            }
            Ok(())
        })
    }

    /// The recorded fingerprints of rank `rank`'s steps of outer iteration
    /// `outer`, by step.
    pub fn batch_digests(
        &self,
        run_id: &str,
        outer: u64,
        rank: u32,
        kind: PrintKind,
    ) -> Result<Vec<(u64, String)>> {
        self.require_run(&self.conn, run_id)?;
        let mut st = self
            .conn
            .prepare_cached(
                "SELECT step, digest FROM batches \
                 WHERE run_id = ?1 AND outer = ?2 AND rank = ?3 AND kind = ?4 ORDER BY step",
            )
            .db(&self.path)?;
        let rows = st
            .query_map(params![run_id, to_i64(outer), rank, kind.as_str()], |r| {
                Ok((to_u64(r.get::<_, i64>(0)?), r.get::<_, String>(1)?))
            })
            .db(&self.path)?;
        rows.collect::<rusqlite::Result<_>>().db(&self.path)
    }

    /// The ranks whose fingerprints the run holds, in order.
    pub fn batch_ranks(&self, run_id: &str) -> Result<Vec<u32>> {
        let mut st = self
            .conn
            .prepare_cached("SELECT DISTINCT rank FROM batches WHERE run_id = ?1 ORDER BY rank")
            .db(&self.path)?;
        let rows = st
            .query_map([run_id], |r| r.get::<_, u32>(0))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every recording's batch fingerprints, computed by another xxh3
    /// implementation: a resume or replay of a run recorded before the
    /// hash crate changed still matches its steps (a tensor-sized part
    /// takes the SIMD path, the framed small parts the short one).
    #[test]
    fn the_format_is_the_reference_xxh3_128_over_framed_parts() {
        let tensor: Vec<u8> = (0..32_768u32).map(|i| (i * 7 % 251) as u8).collect();
        let parts: [&[u8]; 4] = [
            b"list 2",
            b"tensor torch.float32 (32, 1, 16, 16)",
            &tensor,
            b"int 5",
        ];
        let mut d = BatchDigest::new();
        let mut small = Vec::new();
        BatchDigest::frame(&mut small, parts[0]);
        BatchDigest::frame(&mut small, parts[1]);
        d.framed(&small);
        d.part(parts[2]);
        d.part(parts[3]);
        let mut reference = xxhash_rust::xxh3::Xxh3::new();
        for p in parts {
            reference.update(&(p.len() as u64).to_le_bytes());
            reference.update(p);
        }
        assert_eq!(d.finish(), format!("{:032x}", reference.digest128()));
    }
}
