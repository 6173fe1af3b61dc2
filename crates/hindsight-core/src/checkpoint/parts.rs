//! The store side of multi-rank checkpoints (`checkpoint::shard` holds the
//! rules): committing the ranks' parts as one checkpoint, and reading the
//! region of an array one rank of another layout holds.

use std::time::{Duration, Instant};

use crate::checkpoint::cancel::Cancel;
use crate::checkpoint::format::{ArrayLib, Manifest, Node, Sharded};
use crate::checkpoint::shard;
use crate::checkpoint::store::Store;
use crate::error::{Error, Result};

/// Which box of which array to read: the array's key path, and where the
/// box starts and how far it extends in each dimension.
#[derive(Clone, Debug)]
pub struct RegionRequest {
    pub path: Vec<String>,
    /// The whole array's shape as the reader has it: another shape than the
    /// saved one is an error, never a sub-box read as if it were the whole.
    pub whole: Vec<u64>,
    pub offset: Vec<u64>,
    pub shape: Vec<u64>,
}

/// A box of an array read from a checkpoint, row-major.
#[derive(Debug)]
pub struct Region {
    pub lib: ArrayLib,
    pub dtype: String,
    pub shape: Vec<u64>,
    pub data: Vec<u8>,
}

/// A part older than this whose checkpoint never committed belongs to a
/// job that died mid-save: gc removes it (a save takes seconds to minutes).
pub const STALE_PART: Duration = Duration::from_secs(24 * 3600);

impl Store {
    /// Remove the parts no commit will use: those of a checkpoint committed
    /// after them (the committing rank died before removing them) and those
    /// older than [`STALE_PART`]. Returns how many were removed.
    pub fn remove_stale_parts(&self, now_ms: u64) -> Result<u64> {
        let all = self.storage().list_manifests()?;
        let mut removed = 0;
        for name in all.iter().filter(|n| shard::is_part(n)) {
            let Some(shard::PartName { base, .. }) = shard::parse_part(name) else {
                continue;
            };
            let Ok(part) = self.manifest(name) else {
                continue; // gc names unreadable manifests itself
            };
            let committed_after = all.iter().any(|n| n == base)
                && self
                    .manifest(base)
                    .is_ok_and(|m| m.created_ms >= part.created_ms);
            let old = now_ms.saturating_sub(part.created_ms) > STALE_PART.as_millis() as u64;
            if (committed_after || old) && self.storage().delete_manifest(name)? {
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// The ranks whose part of checkpoint `name`, saved by `world` ranks
    /// in save attempt `attempt`, is committed.
    pub fn parts_present(&self, name: &str, world: u64, attempt: &str) -> Result<Vec<u64>> {
        let mut ranks: Vec<u64> = self
            .storage()
            .list_manifests()?
            .iter()
            .filter_map(|n| shard::parse_part(n))
            .filter(|p| p.base == name && p.world == world && p.attempt == Some(attempt))
            .map(|p| p.rank)
            .collect();
        ranks.sort_unstable();
        Ok(ranks)
    }

    /// Merge the parts of `name` that `world` ranks commit in save attempt
    /// `attempt` into its one manifest and commit it, then remove them.
    /// Waits up to `timeout` for every part (each rank commits its own once
    /// its chunks are durable); a rank that never commits one leaves
    /// nothing listed. Parts of other attempts (a rank's part left by an
    /// earlier save of the name that died, another job's save of it) are
    /// never merged: gc removes them once this commit is newer.
    pub fn commit_parts(
        &self,
        name: &str,
        world: u64,
        attempt: &str,
        timeout: Duration,
        cancel: Cancel<'_>,
    ) -> Result<Manifest> {
        crate::checkpoint::format::validate_name(name)?;
        let start = Instant::now();
        let mut pause = Duration::from_millis(1);
        loop {
            let present = self.parts_present(name, world, attempt)?;
            if present.len() as u64 == world {
                break;
            }
            if cancel() {
                return Err(Error::interrupted("commit of a multi-rank checkpoint"));
            }
            if start.elapsed() >= timeout {
                let missing: Vec<String> = (0..world)
                    .filter(|r| !present.contains(r))
                    .map(|r| r.to_string())
                    .collect();
                return Err(Error::invalid(
                    format!("checkpoint '{name}'"),
                    format!(
                        "rank(s) {} of {world} committed no part within {:.0} s (a rank died or is \
                         still saving): the checkpoint is not committed",
                        missing.join(", "),
                        timeout.as_secs_f64()
                    ),
                ));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(50));
        }
        let names: Vec<String> = (0..world)
            .map(|r| shard::part_name(name, r, world, attempt))
            .collect::<Result<_>>()?;
        let parts: Vec<Manifest> = names
            .iter()
            .map(|n| self.manifest(n))
            .collect::<Result<_>>()?;
        let merged = shard::merge(name, world, parts)?;
        merged.refuse_superseded(self.storage().committed(name)?.as_ref())?;
        let bytes = merged.encode()?;
        // The one commit: the merged manifest references only chunks the
        // parts (live for gc) reference, and the parts go only after it.
        self.storage().put_manifest(name, &bytes)?;
        for n in &names {
            self.storage().delete_manifest(n)?;
        }
        Ok(merged)
    }

    /// Boxes of arrays of checkpoint `name` (sharded or whole), each at a
    /// key path with an `offset` and `shape`: the manifest is read once,
    /// and only the chunks of the pieces each box overlaps are read (and
    /// verified), all together on up to `threads` threads.
    pub fn read_regions(
        &self,
        name: &str,
        wanted: &[RegionRequest],
        threads: usize,
        cancel: Cancel<'_>,
    ) -> Result<Vec<Region>> {
        let manifest = self.manifest(name)?;
        struct Planned {
            sharded: Sharded,
            reads: Vec<shard::PieceRead>,
            /// (first byte in its piece, the blob read) per segment, per piece read.
            segs: Vec<Vec<u64>>,
        }
        let mut planned = Vec::with_capacity(wanted.len());
        let mut items = Vec::new();
        for w in wanted {
            let key = w.path.join("/");
            let node = manifest
                .root
                .select(&w.path)
                .ok_or_else(|| Error::NotFound {
                    what: "key path",
                    name: key.clone(),
                    location: format!("checkpoint '{name}' in store {}", self.location()),
                })?;
            let sharded = shard::as_sharded(node)
                .ok_or_else(|| {
                    Error::invalid(
                        format!("key path '{key}'"),
                        format!(
                            "checkpoint '{name}' holds a {} there, not an array",
                            node.kind()
                        ),
                    )
                })?
                .into_owned();
            if sharded.shape != w.whole {
                return Err(Error::invalid(
                    format!("key path '{key}'"),
                    format!(
                        "checkpoint '{name}' holds an array of shape {:?} there; the live one has shape {:?}",
                        sharded.shape, w.whole
                    ),
                ));
            }
            let reads = shard::plan(&sharded, &w.offset, &w.shape).map_err(|d| {
                Error::invalid(format!("region of '{key}' in checkpoint '{name}'"), d)
            })?;
            let mut segs = Vec::with_capacity(reads.len());
            for r in &reads {
                let mine = shard::segments(&sharded.shards[r.shard].array.data, &r.runs);
                segs.push(mine.iter().map(|(s, _)| *s).collect());
                // Keyed by the array's path: a damaged chunk is reported there.
                items.extend(
                    mine.into_iter()
                        .map(|(_, b)| (Node::Str(key.clone()), Node::Bytes(b))),
                );
            }
            planned.push(Planned {
                sharded,
                reads,
                segs,
            });
        }
        let buffers = self.read_blobs(name, &Node::Dict(items), &[], threads, cancel)?;
        let mut bufs = buffers.iter();
        let mut out = Vec::with_capacity(wanted.len());
        for (w, p) in wanted.iter().zip(planned) {
            let first = p.sharded.shards.first().map(|s| &s.array);
            let (lib, dtype) = first.map_or((ArrayLib::Torch, String::new()), |a| {
                (a.lib, a.dtype.clone())
            });
            let item = crate::checkpoint::format::itemsize(lib, &dtype).unwrap_or(1);
            let mut data = usize::try_from(w.shape.iter().product::<u64>() * item)
                .ok()
                .and_then(crate::staging::try_zeroed)
                .ok_or_else(|| {
                    Error::invalid(
                        format!("region of '{}' in checkpoint '{name}'", w.path.join("/")),
                        "more bytes than can be allocated here",
                    )
                })?;
            for (r, seg) in p.reads.iter().zip(&p.segs) {
                let view: Vec<(u64, &[u8])> = seg
                    .iter()
                    .map(|start| (*start, bufs.next().map_or(&[][..], |b| b.as_slice())))
                    .collect();
                shard::copy_runs(&r.runs, &view, &mut data)
                    .map_err(|d| Error::internal(d.to_string()))?;
            }
            out.push(Region {
                lib,
                dtype,
                shape: w.shape.clone(),
                data,
            });
        }
        Ok(out)
    }
}
