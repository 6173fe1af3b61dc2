//! The store side of multi-rank checkpoints (`checkpoint::shard` holds the
//! rules): committing the ranks' parts as one checkpoint, and reading the
//! region of an array one rank of another layout holds.

use std::time::{Duration, Instant};

use crate::checkpoint::format::{ArrayLib, Manifest, Node};
use crate::checkpoint::shard;
use crate::checkpoint::store::Store;
use crate::checkpoint::writer::Cancel;
use crate::error::{Error, Result};

/// A box of an array read from a checkpoint, row-major.
#[derive(Debug)]
pub struct Region {
    pub lib: ArrayLib,
    pub dtype: String,
    pub shape: Vec<u64>,
    pub data: Vec<u8>,
}

impl Store {
    /// The ranks whose part of checkpoint `name` (saved by `world` ranks) is committed.
    pub fn parts_present(&self, name: &str, world: u64) -> Result<Vec<u64>> {
        let mut ranks: Vec<u64> = self
            .storage()
            .list_manifests()?
            .iter()
            .filter_map(|n| shard::parse_part(n))
            .filter(|(base, _, w)| *base == name && *w == world)
            .map(|(_, r, _)| r)
            .collect();
        ranks.sort_unstable();
        Ok(ranks)
    }

    /// Merge the parts of `name` that `world` ranks commit into its one
    /// manifest and commit it, then remove the parts. Waits up to `timeout`
    /// for every part (each rank commits its own once its chunks are
    /// durable); a rank that never commits one leaves nothing listed.
    pub fn commit_parts(
        &self,
        name: &str,
        world: u64,
        timeout: Duration,
        cancel: Cancel<'_>,
    ) -> Result<Manifest> {
        crate::checkpoint::format::validate_name(name)?;
        let start = Instant::now();
        let mut pause = Duration::from_millis(1);
        loop {
            let present = self.parts_present(name, world)?;
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
            .map(|r| shard::part_name(name, r, world))
            .collect::<Result<_>>()?;
        let parts: Vec<Manifest> = names
            .iter()
            .map(|n| self.manifest(n))
            .collect::<Result<_>>()?;
        let merged = shard::merge(name, world, parts)?;
        let bytes = merged.encode()?;
        // The one commit: the merged manifest references only chunks the
        // parts (live for gc) reference, and the parts go only after it.
        self.storage().put_manifest(name, &bytes)?;
        for n in &names {
            self.storage().delete_manifest(n)?;
        }
        Ok(merged)
    }

    /// The box (`offset`, `shape`) of the array at key path `path` of
    /// checkpoint `name` (sharded or whole), reading and verifying only the
    /// chunks of the pieces it overlaps.
    pub fn read_region(
        &self,
        name: &str,
        path: &[String],
        offset: &[u64],
        shape: &[u64],
        threads: usize,
        cancel: Cancel<'_>,
    ) -> Result<Region> {
        let manifest = self.manifest(name)?;
        let node = manifest.root.select(path).ok_or_else(|| Error::NotFound {
            what: "key path",
            name: path.join("/"),
            location: format!("checkpoint '{name}' in store {}", self.location()),
        })?;
        let key = path.join("/");
        let sh = shard::as_sharded(node).ok_or_else(|| {
            Error::invalid(
                format!("key path '{key}'"),
                format!(
                    "checkpoint '{name}' holds a {} there, not an array",
                    node.kind()
                ),
            )
        })?;
        let bad =
            |d: String| Error::invalid(format!("region of '{key}' in checkpoint '{name}'"), d);
        let reads = shard::plan(&sh, offset, shape).map_err(bad)?;
        // One list of the segments of every piece, read (and verified) together.
        let mut segs: Vec<Vec<(u64, u64)>> = Vec::with_capacity(reads.len());
        let mut items = Vec::new();
        for r in &reads {
            let mine = shard::segments(&sh.shards[r.shard].array.data, &r.runs);
            segs.push(mine.iter().map(|(s, b)| (*s, b.nbytes)).collect());
            items.extend(mine.into_iter().map(|(_, b)| Node::Bytes(b)));
        }
        let buffers = self.read_blobs(name, &Node::List(items), path, threads, cancel)?;
        let first = sh.shards.first().map(|p| &p.array);
        let (lib, dtype) = first.map_or((ArrayLib::Torch, String::new()), |a| {
            (a.lib, a.dtype.clone())
        });
        let item = crate::checkpoint::format::itemsize(lib, &dtype).unwrap_or(1);
        let total = usize::try_from(shape.iter().product::<u64>() * item)
            .ok()
            .and_then(crate::staging::try_zeroed)
            .ok_or_else(|| bad("more bytes than can be allocated here".into()))?;
        let mut data = total;
        let mut bufs = buffers.iter();
        for (r, seg) in reads.iter().zip(&segs) {
            let view: Vec<(u64, &[u8])> = seg
                .iter()
                .map(|(start, _)| (*start, bufs.next().map_or(&[][..], |b| b.as_slice())))
                .collect();
            shard::copy_runs(&r.runs, &view, &mut data)
                .map_err(|d| Error::internal(d.to_string()))?;
        }
        Ok(Region {
            lib,
            dtype,
            shape: shape.to_vec(),
            data,
        })
    }
}
