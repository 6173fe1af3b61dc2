//! What a user opens as "a store": one store, or in local-first mode a local
//! replica in front of its destination. Every front end (the Python binding,
//! the CLI) goes through this type, so both see the same rules: where a
//! checkpoint is read from, what is listed, the order of a removal, which
//! copy is verified, and that gc covers both sides.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, OnceLock};

use crate::checkpoint::cancel::Cancel;
use crate::checkpoint::format::{Manifest, Node};
use crate::checkpoint::naming::{self, CheckpointId};
use crate::checkpoint::parts::{Region, RegionRequest};
use crate::checkpoint::retention::{self, Entry, Retention};
use crate::checkpoint::shard;
use crate::checkpoint::store::{DescribeRow, GcReport, Problem, Store, StoreOptions, Usage};
use crate::checkpoint::upload::Uploader;
use crate::checkpoint::writer::{Writer, WriterOptions};
use crate::error::{Error, Result};

/// Manifest metadata keys of a checkpoint's retention metric.
pub const META_MONITOR: &str = "monitor";
pub const META_METRIC: &str = "metric";

/// Where a retention pass finds each block checkpoint's metric.
#[derive(Debug)]
pub enum MetricSource<'a> {
    None,
    /// Values by outer-loop index (e.g. from the run's logs).
    ByIndex(&'a HashMap<u64, f64>),
    /// The checkpoint's own metadata, written with the checkpoint, when its
    /// `monitor` is this one.
    Meta {
        monitor: &'a str,
    },
}

#[derive(Debug)]
pub struct Replica {
    /// Where saves commit: the destination, or the local copy in local-first mode.
    primary: Arc<Store>,
    /// Local-first mode: the destination the uploader copies to.
    destination: Option<Arc<Store>>,
    /// Local-first mode, once a writer started: the uploader it feeds.
    uploader: OnceLock<Arc<Uploader>>,
}

/// A checkpoint (or the part of it under a key path) read and verified.
#[derive(Debug)]
pub struct ReadTree {
    pub manifest: Manifest,
    /// The node at the requested key path.
    pub node: Node,
    /// The bytes of every blob under `node`, in tree order.
    pub buffers: Vec<Vec<u8>>,
    /// The arrays the read was asked to leave out (None in their places).
    pub left_out: Vec<LeftOut>,
}

/// An array a read left out for its caller to read only the boxes it
/// holds (`read_regions`): a rank's shards of a sharded model, say,
/// without the whole array in memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeftOut {
    /// Its key path from the checkpoint's root.
    pub path: Vec<String>,
    pub dtype: String,
    /// The whole array's shape.
    pub shape: Vec<u64>,
}

/// Threads a load reads and verifies on: hashing is the bottleneck of a
/// warm read, so one per core, up to 16.
pub fn default_read_threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get().clamp(2, 16))
}

impl Replica {
    /// Open `location` (a directory or `s3://bucket/prefix`, see
    /// [`Store::open_url`]); with `local_first`, a local store in front of it
    /// that takes the destination's options, so chunks are cut alike.
    pub fn open(
        location: &str,
        local_first: Option<&Path>,
        create: bool,
        options: Option<StoreOptions>,
    ) -> Result<Replica> {
        let dest = Arc::new(Store::open_url(location, create, options)?);
        let Some(local_path) = local_first else {
            return Ok(Replica::single(dest));
        };
        let local = match Store::open_local(local_path, false, None) {
            Err(Error::NotFound { .. }) => {
                Store::open_local(local_path, true, Some(dest.options().clone()))?
            }
            other => other?,
        };
        Ok(Replica {
            primary: Arc::new(local),
            destination: Some(dest),
            uploader: OnceLock::new(),
        })
    }

    /// One store, no replica.
    pub fn single(store: Arc<Store>) -> Replica {
        Replica {
            primary: store,
            destination: None,
            uploader: OnceLock::new(),
        }
    }

    /// Start the background writer (in local-first mode with its uploader,
    /// which first queues what a killed process left un-uploaded).
    pub fn start_writer(&self, options: WriterOptions) -> Result<Writer> {
        let Some(dest) = &self.destination else {
            return Writer::new(self.primary.clone(), options);
        };
        let uploader = match self.uploader.get() {
            Some(u) => u.clone(),
            None => {
                let u = Arc::new(Uploader::new(self.primary.clone(), dest.clone())?);
                self.uploader.get_or_init(|| u).clone()
            }
        };
        Writer::local_first(uploader, options)
    }

    /// The store saves commit to.
    pub fn primary(&self) -> &Arc<Store> {
        &self.primary
    }

    /// The destination (the primary store unless local-first).
    pub fn destination(&self) -> &Arc<Store> {
        self.destination.as_ref().unwrap_or(&self.primary)
    }

    /// The local copy's location in local-first mode.
    pub fn local_location(&self) -> Option<String> {
        self.destination.as_ref().map(|_| self.primary.location())
    }

    /// Every store this spans, destination last.
    fn all(&self) -> impl Iterator<Item = &Arc<Store>> {
        std::iter::once(&self.primary).chain(self.destination.as_ref())
    }

    /// The store that holds `name`: the local copy if it has it, else the destination.
    pub fn holder(&self, name: &str) -> Result<&Arc<Store>> {
        match &self.destination {
            Some(dest) if !self.primary.list()?.iter().any(|n| n == name) => Ok(dest),
            _ => Ok(&self.primary),
        }
    }

    /// Complete checkpoints; in local-first mode also those complete only locally.
    pub fn list(&self) -> Result<Vec<String>> {
        let mut names = Vec::new();
        for s in self.all() {
            names.extend(s.list()?);
        }
        names.sort();
        names.dedup();
        Ok(names)
    }

    pub fn manifest(&self, name: &str) -> Result<Manifest> {
        self.holder(name)?.manifest(name)
    }

    pub fn describe(&self, name: &str) -> Result<(Manifest, Vec<DescribeRow>)> {
        self.holder(name)?.describe(name)
    }

    /// Read checkpoint `name`, or the sub-tree at key path `path`, verifying
    /// every chunk, on up to `threads` threads ([`default_read_threads`]).
    pub fn read(
        &self,
        name: &str,
        path: &[String],
        threads: usize,
        cancel: Cancel<'_>,
    ) -> Result<ReadTree> {
        self.read_leaving_out(name, path, &[], threads, cancel)
    }

    /// [`Self::read`], except for the arrays at the key paths `skip`
    /// (relative to `path`), which are not read but listed
    /// ([`ReadTree::left_out`]); a path holding no array is read as usual.
    pub fn read_leaving_out(
        &self,
        name: &str,
        path: &[String],
        skip: &[Vec<String>],
        threads: usize,
        cancel: Cancel<'_>,
    ) -> Result<ReadTree> {
        let store = self.holder(name)?;
        // Another process may replace (save again) or remove the checkpoint
        // and gc its old chunks while we read. A failed read is damage only
        // if the manifest is still the one we read; otherwise read the new
        // one, or report the removal. Never call a race corruption.
        const ATTEMPTS: usize = 3;
        for _ in 0..ATTEMPTS {
            let manifest = store.manifest(name)?;
            let mut node = manifest
                .root
                .select(path)
                .cloned()
                .ok_or_else(|| Error::NotFound {
                    what: "key path",
                    name: path.join("/"),
                    location: format!("checkpoint '{name}' in store {}", store.location()),
                })?;
            let left_out: Vec<LeftOut> = skip
                .iter()
                .filter_map(|rel| {
                    let (dtype, shape) = node.take_array(rel)?;
                    let path = path.iter().chain(rel).cloned().collect();
                    Some(LeftOut { path, dtype, shape })
                })
                .collect();
            let err = match store.read_blobs(name, &node, path, threads, cancel) {
                Ok(buffers) => {
                    // Sharded arrays come back whole (a load on one process).
                    let (node, buffers) = shard::consolidate(node, buffers).map_err(|d| {
                        Error::corrupt(store.storage().manifest_path(name), d)
                            .in_checkpoint(name, &path.join("/"))
                    })?;
                    return Ok(ReadTree {
                        manifest,
                        node,
                        buffers,
                        left_out,
                    });
                }
                Err(e @ (Error::Corrupt { .. } | Error::NotFound { .. })) => e,
                Err(e) => return Err(e),
            };
            match store.manifest(name) {
                Err(Error::NotFound { .. }) => {
                    return Err(Error::NotFound {
                        what: "checkpoint",
                        name: name.to_string(),
                        location: format!(
                            "store {} (removed by another process while it was being loaded)",
                            store.location()
                        ),
                    })
                }
                Ok(now) if now != manifest => continue, // replaced: read the new one
                _ => return Err(err),
            }
        }
        Err(Error::Precondition {
            path: store.storage().manifest_path(name),
            source: std::io::Error::other(format!(
                "checkpoint '{name}' was replaced by another process {ATTEMPTS} times while loading; load again"
            )),
        })
    }

    /// Boxes of arrays of checkpoint `name` ([`Store::read_regions`]).
    pub fn read_regions(
        &self,
        name: &str,
        wanted: &[RegionRequest],
        threads: usize,
        cancel: Cancel<'_>,
    ) -> Result<Vec<Region>> {
        self.holder(name)?
            .read_regions(name, wanted, threads, cancel)
    }

    /// Commit the parts `world` ranks saved of `name` as one checkpoint
    /// ([`Store::commit_parts`]). Not in local-first mode: each node's
    /// parts would sit on its own disk, where no one rank can merge them.
    pub fn commit_parts(
        &self,
        name: &str,
        world: u64,
        attempt: &str,
        timeout: std::time::Duration,
        cancel: Cancel<'_>,
    ) -> Result<Manifest> {
        if self.destination.is_some() && world > 1 {
            return Err(Error::invalid(
                "local_first",
                "a checkpoint saved by several ranks needs one store they all reach; \
                 local-first mode keeps each rank's part on its own disk",
            ));
        }
        self.primary
            .commit_parts(name, world, attempt, timeout, cancel)
    }

    /// Remove a checkpoint. Local-first: locally first, then at the
    /// destination, so a crash in between never leaves a local copy that
    /// would be uploaded again.
    pub fn remove(&self, name: &str) -> Result<()> {
        let Some(dest) = &self.destination else {
            return self.primary.remove(name);
        };
        if let Some(u) = self.uploader.get() {
            u.forget(name);
        }
        let here = match self.primary.remove(name) {
            Err(Error::NotFound { .. }) => false,
            r => r.map(|_| true)?,
        };
        match dest.remove(name) {
            Err(Error::NotFound { .. }) if here => Ok(()),
            r => r,
        }
    }

    /// Verify checkpoints (all when `names` is empty): uploaded ones at the
    /// destination, the others (and unknown names, reported missing) where they are.
    pub fn verify(
        &self,
        names: &[String],
        mut progress: impl FnMut(&str),
    ) -> Result<(usize, Vec<Problem>)> {
        let dest = self.destination();
        let mut jobs = vec![(dest, names.to_vec())];
        if self.destination.is_some() {
            let at_dest = dest.list()?;
            let local = self.primary.list()?;
            let wanted = if names.is_empty() {
                let mut all: Vec<String> = at_dest.iter().chain(&local).cloned().collect();
                all.sort();
                all.dedup();
                all
            } else {
                names.to_vec()
            };
            let (there, here): (Vec<String>, Vec<String>) = wanted
                .into_iter()
                .partition(|x| at_dest.contains(x) || !local.contains(x));
            jobs = vec![(dest, there), (&self.primary, here)];
            jobs.retain(|(_, n)| !n.is_empty());
        }
        let (mut n, mut problems) = (0, Vec::new());
        for (store, names) in jobs {
            let (k, p) = store.verify(&names, &mut progress)?;
            n += k;
            problems.extend(p);
        }
        Ok((n, problems))
    }

    /// Delete unreferenced chunks on every side.
    pub fn gc(&self) -> Result<GcReport> {
        let mut total = GcReport::default();
        for s in self.all() {
            let r = s.gc()?;
            total.chunks_removed += r.chunks_removed;
            total.bytes_removed += r.bytes_removed;
            total.staging_files_removed += r.staging_files_removed;
            total.unreadable.extend(r.unreadable);
        }
        Ok(total)
    }

    /// This prefix's checkpoints, oldest first in resume order.
    pub fn checkpoints(&self, prefix: &str) -> Result<Vec<CheckpointId>> {
        Ok(naming::with_prefix(&self.list()?, prefix))
    }

    /// Apply `policy` to the checkpoints of `prefix` (see
    /// [`retention::removals`]) and return the names removed. A checkpoint
    /// another process removed meanwhile is not an error.
    pub fn apply_retention(
        &self,
        prefix: &str,
        policy: &Retention,
        metrics: MetricSource<'_>,
    ) -> Result<Vec<String>> {
        if policy.is_empty() {
            return Ok(Vec::new());
        }
        let mut entries = Vec::new();
        for id in self.checkpoints(prefix)? {
            let metric = match (
                &metrics,
                policy.keep_best.is_some() && !id.kind.is_interim(),
            ) {
                (_, false) | (MetricSource::None, _) => None,
                (MetricSource::ByIndex(m), true) => m.get(&id.index).copied(),
                (MetricSource::Meta { monitor }, true) => self.metric_in_meta(&id, monitor)?,
            };
            entries.push(Entry { id, metric });
        }
        let mut removed = Vec::new();
        for id in retention::removals(&entries, prefix, policy) {
            let name = id.name();
            match self.remove(&name) {
                Ok(()) => removed.push(name),
                Err(Error::NotFound { .. }) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(removed)
    }

    /// The metric recorded in a checkpoint's metadata for `monitor`.
    fn metric_in_meta(&self, id: &CheckpointId, monitor: &str) -> Result<Option<f64>> {
        let meta = match self.manifest(&id.name()) {
            Ok(m) => m.meta,
            Err(Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e),
        };
        if meta.get(META_MONITOR).map(String::as_str) != Some(monitor) {
            return Ok(None);
        }
        Ok(meta.get(META_METRIC).and_then(|v| v.parse().ok()))
    }

    /// Space used at the destination.
    pub fn usage(&self) -> Result<Usage> {
        self.destination().usage()
    }
}
