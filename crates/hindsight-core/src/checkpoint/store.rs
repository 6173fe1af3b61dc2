//! A checkpoint store: options, reading and verifying checkpoints, and the
//! housekeeping operations (list, remove, gc, du, verify).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Read;
use std::path::Path;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use crate::checkpoint::cancel::Cancel;
use crate::checkpoint::format::{
    self, Blob, ChunkId, Codec, Manifest, Node, PackSlice, CHUNK_HEADER_LEN, FORMAT_VERSION,
};
use crate::checkpoint::location::Location;
use crate::checkpoint::storage::{LocalStorage, Storage, CONFIG_FILE};
use crate::error::{Error, Result};
use crate::sync::lock;

pub const DEFAULT_CHUNK_SIZE: usize = 4 << 20;

/// Per-store options, fixed when the store is created.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoreOptions {
    pub format: u32,
    /// Codec for new chunks. Raw by default: float weights barely compress
    /// (measured in `make bench`), and zstd would cost more time than it saves.
    pub codec: Codec,
    pub zstd_level: i32,
    /// Tensors are cut into chunks of at most this many bytes.
    pub chunk_size: usize,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            format: FORMAT_VERSION,
            codec: Codec::Raw,
            zstd_level: 1,
            chunk_size: DEFAULT_CHUNK_SIZE,
        }
    }
}

/// What one load reads: (destination, chunk, key) or (pack, its raw
/// length, the slices wanted from it with their destinations and keys).
enum LoadUnit<'a> {
    Whole(&'a mut [u8], ChunkId, &'a str),
    Pack(
        ChunkId,
        u64,
        Vec<(&'a mut [u8], format::PackSlice, &'a str)>,
    ),
}

#[derive(Debug)]
pub struct Store {
    storage: Arc<dyn Storage>,
    options: StoreOptions,
}

/// What `du` reports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Usage {
    pub checkpoints: usize,
    /// Sum of every checkpoint's data as if each were stored alone.
    pub logical_bytes: u64,
    /// Raw bytes of the distinct chunks the checkpoints reference.
    pub unique_bytes: u64,
    /// Encoded chunk files plus manifests, as stored.
    pub stored_bytes: u64,
    pub chunks: usize,
    /// Chunks on storage that no checkpoint references (gc would remove them).
    pub unreferenced_chunks: usize,
    /// Checkpoints whose manifest does not decode, with why: not counted.
    pub unreadable: Vec<(String, String)>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    pub chunks_removed: usize,
    pub bytes_removed: u64,
    pub staging_files_removed: u64,
    /// Checkpoints whose manifest does not decode, with why: every chunk id
    /// their bytes name was kept.
    pub unreadable: Vec<(String, String)>,
}

/// What the checkpoints of a store reference (see `Store::referenced`).
#[derive(Default)]
struct Referenced {
    /// Checkpoints read.
    count: usize,
    /// Their data as if each were stored alone.
    logical: u64,
    /// Chunk id -> raw length (0 where only a scan named it).
    refs: HashMap<ChunkId, u64>,
    /// (name, why) of manifests that do not decode.
    unreadable: Vec<(String, String)>,
    /// Some manifest names chunks nobody can tell (not even a scan finds
    /// its chunk ids): gc may not delete any chunk while it is there.
    unscannable: bool,
    /// Digest of each manifest's bytes as read.
    digests: HashMap<String, blake3::Hash>,
}

/// One row of [`Store::describe`]: (key path, kind and detail, bytes).
pub type DescribeRow = (String, String, u64);

/// One problem found by `verify`.
#[derive(Debug)]
pub struct Problem {
    pub checkpoint: Option<String>,
    pub error: Error,
}

/// Marks the one read error that blames the manifest, not the chunk.
const MANIFEST_EXPECTS: &str = "manifest expects";

impl Store {
    /// Open a store in a local directory; create it (with `options`) if `create` and missing.
    pub fn open_local(root: &Path, create: bool, options: Option<StoreOptions>) -> Result<Store> {
        // Both checked before `LocalStorage::open`, which creates directories:
        // a refused open leaves nothing behind.
        if let Some(o) = &options {
            check_options(o)?;
        }
        let config = root.join(CONFIG_FILE);
        // try_exists, not exists: an unreadable store is not a missing one.
        let exists = config.try_exists().map_err(|e| Error::io(&config, e))?;
        if !create && !exists {
            return Err(Error::NotFound {
                what: "store",
                name: root.display().to_string(),
                location: format!("no {CONFIG_FILE} in that directory"),
            });
        }
        Store::open_storage(Arc::new(LocalStorage::open(root)?), create, options)
    }

    /// Open a store by location: `s3://bucket/prefix` (with the `s3` feature;
    /// connection settings from the AWS environment variables) or a local directory.
    pub fn open_url(url: &str, create: bool, options: Option<StoreOptions>) -> Result<Store> {
        match Location::parse(url, "store")? {
            #[cfg(feature = "s3")]
            Location::Object(url) => Store::open_storage(
                Arc::new(crate::checkpoint::object::ObjectStorage::open_parsed(&url)?),
                create,
                options,
            ),
            #[cfg(not(feature = "s3"))]
            Location::Object(url) => Err(Error::invalid(
                "store URL",
                format!("{url}: this build of hindsight has no S3 support (cargo feature `s3`)"),
            )),
            Location::Local(dir) => Store::open_local(&dir, create, options),
        }
    }

    /// Open the store kept in `storage` (its options file says how it was
    /// created); create it with `options` if `create` and it has none.
    pub fn open_storage(
        storage: Arc<dyn Storage>,
        create: bool,
        options: Option<StoreOptions>,
    ) -> Result<Store> {
        let config = storage.config_path();
        let Some(bytes) = storage.get_config()? else {
            if !create {
                return Err(Error::NotFound {
                    what: "store",
                    name: storage.location(),
                    location: format!("no {CONFIG_FILE} there"),
                });
            }
            let options = options.unwrap_or_else(|| StoreOptions {
                chunk_size: storage.preferred_chunk_size().unwrap_or(DEFAULT_CHUNK_SIZE),
                ..StoreOptions::default()
            });
            check_options(&options)?;
            let bytes = serde_json::to_vec_pretty(&options)
                .map_err(|e| Error::internal(format!("store options did not serialize: {e}")))?;
            // Two processes creating one store write the same options; the last write wins.
            storage.put_config(&bytes)?;
            return Ok(Store { storage, options });
        };
        let stored: StoreOptions = serde_json::from_slice(&bytes)
            .map_err(|e| Error::corrupt(&config, format!("store options do not parse: {e}")))?;
        if stored.format != FORMAT_VERSION {
            return Err(Error::corrupt(
                &config,
                format!(
                    "store format {} is not supported (this hindsight reads {FORMAT_VERSION})",
                    stored.format
                ),
            ));
        }
        check_options(&stored).map_err(|e| Error::corrupt(&config, e.to_string()))?;
        if let Some(asked) = options {
            if asked.codec != stored.codec || asked.chunk_size != stored.chunk_size {
                return Err(Error::invalid(
                    "store options",
                    format!(
                        "store {} was created with codec {:?} and chunk size {}; options are fixed at creation",
                        storage.location(),
                        stored.codec,
                        stored.chunk_size
                    ),
                ));
            }
        }
        Ok(Store {
            storage,
            options: stored,
        })
    }

    /// A store over any backend (tests inject failing storage this way).
    pub fn with_storage(storage: Arc<dyn Storage>, options: StoreOptions) -> Result<Store> {
        check_options(&options)?;
        Ok(Store { storage, options })
    }

    pub fn storage(&self) -> &Arc<dyn Storage> {
        &self.storage
    }

    pub fn options(&self) -> &StoreOptions {
        &self.options
    }

    pub fn location(&self) -> String {
        self.storage.location()
    }

    /// The committed checkpoints (not the parts of multi-rank saves in flight).
    pub fn list(&self) -> Result<Vec<String>> {
        let mut names = self.storage.list_manifests()?;
        names.retain(|n| !crate::checkpoint::shard::is_part(n));
        Ok(names)
    }

    pub fn manifest(&self, name: &str) -> Result<Manifest> {
        format::validate_name(name)?;
        let bytes = self.storage.get_manifest(name)?;
        let m = Manifest::decode(&bytes, &self.storage.manifest_path(name))?;
        if m.name != name {
            return Err(Error::corrupt(
                self.storage.manifest_path(name),
                format!(
                    "manifest holds checkpoint '{}' under the name '{name}'",
                    m.name
                ),
            ));
        }
        Ok(m)
    }

    pub fn remove(&self, name: &str) -> Result<()> {
        format::validate_name(name)?;
        if !self.storage.delete_manifest(name)? {
            return Err(Error::NotFound {
                what: "checkpoint",
                name: name.into(),
                location: format!("store {}", self.location()),
            });
        }
        Ok(())
    }

    /// Read one chunk into `dest` (exactly its raw length) and verify its
    /// hash. A chunk whose file is damaged in itself (header, length, hash)
    /// is quarantined: later saves that hold its bytes write it again, which
    /// repairs every checkpoint sharing it. A length the manifest expects but
    /// the chunk does not have is the manifest's problem, not the chunk's.
    pub fn read_chunk_into(&self, id: &ChunkId, dest: &mut [u8]) -> Result<()> {
        match self.check_chunk_into(id, dest) {
            Err(Error::Corrupt {
                path,
                checkpoint,
                key_path,
                detail,
            }) if !detail.contains(MANIFEST_EXPECTS)
                && self.storage.has_chunk(id).unwrap_or(false) =>
            {
                let detail = match self.quarantine(id) {
                    Ok(true) => format!(
                        "{detail} (quarantined: the next save holding these bytes writes them again)"
                    ),
                    Ok(false) => detail,
                    Err(q) => format!("{detail} (could not quarantine it: {q})"),
                };
                Err(Error::Corrupt {
                    path,
                    checkpoint,
                    key_path,
                    detail,
                })
            }
            r => r,
        }
    }

    /// Move a damaged chunk aside, under the exclusive lock (no save is
    /// between deduplicating against it and committing), after checking
    /// again that it is still damaged (a save may have rewritten it). True
    /// if it was moved.
    fn quarantine(&self, id: &ChunkId) -> Result<bool> {
        let _lock = self.storage.lock_exclusive()?;
        let mut r = self.storage.open_chunk(id)?;
        let mut data = Vec::new();
        r.read_to_end(&mut data)
            .map_err(|e| Error::io(self.storage.chunk_path(id), e))?;
        let intact = data.len() >= CHUNK_HEADER_LEN
            && format::parse_chunk_header(&data[..CHUNK_HEADER_LEN], &self.storage.chunk_path(id))
                .ok()
                .and_then(|(codec, raw_len)| {
                    let payload = &data[CHUNK_HEADER_LEN..];
                    match codec {
                        Codec::Raw => {
                            (payload.len() as u64 == raw_len).then(|| ChunkId::of(payload))
                        }
                        Codec::Zstd => {
                            zstd::bulk::decompress(payload, usize::try_from(raw_len).ok()?)
                                .ok()
                                .filter(|raw| raw.len() as u64 == raw_len)
                                .map(|raw| ChunkId::of(&raw))
                        }
                    }
                })
                .is_some_and(|actual| actual == *id);
        if intact {
            return Ok(false);
        }
        self.storage.quarantine_chunk(id)?;
        Ok(true)
    }

    fn check_chunk_into(&self, id: &ChunkId, dest: &mut [u8]) -> Result<()> {
        let path = self.storage.chunk_path(id);
        let mut r = self.storage.open_chunk(id)?;
        let mut header = [0u8; CHUNK_HEADER_LEN];
        r.read_exact(&mut header)
            .map_err(|e| Error::corrupt(&path, format!("truncated chunk header: {e}")))?;
        let (codec, raw_len) = format::parse_chunk_header(&header, &path)?;
        if raw_len != dest.len() as u64 {
            return Err(Error::corrupt(
                &path,
                format!(
                    "chunk holds {raw_len} bytes, {MANIFEST_EXPECTS} {}",
                    dest.len()
                ),
            ));
        }
        let actual = match codec {
            Codec::Raw => {
                // Hash each piece right after reading it, while it is still in
                // cache: one pass over memory instead of two.
                const PIECE: usize = 256 << 10;
                let mut hasher = blake3::Hasher::new();
                for piece in dest.chunks_mut(PIECE) {
                    r.read_exact(piece).map_err(|e| match e.kind() {
                        std::io::ErrorKind::UnexpectedEof => {
                            Error::corrupt(&path, "chunk is truncated")
                        }
                        _ => Error::io(&path, e),
                    })?;
                    hasher.update(piece);
                }
                let mut extra = [0u8; 1];
                if r.read(&mut extra).map_err(|e| Error::io(&path, e))? != 0 {
                    return Err(Error::corrupt(&path, "chunk has trailing bytes"));
                }
                ChunkId(*hasher.finalize().as_bytes())
            }
            Codec::Zstd => {
                let mut payload = Vec::new();
                r.read_to_end(&mut payload)
                    .map_err(|e| Error::io(&path, e))?;
                let n = zstd::bulk::decompress_to_buffer(&payload, dest).map_err(|e| {
                    Error::corrupt(&path, format!("zstd payload does not decode: {e}"))
                })?;
                if n != dest.len() {
                    return Err(Error::corrupt(
                        &path,
                        format!("zstd payload decodes to {n} bytes, expected {}", dest.len()),
                    ));
                }
                ChunkId::of(dest)
            }
        };
        if actual != *id {
            return Err(Error::corrupt(
                &path,
                "chunk content does not match its hash",
            ));
        }
        Ok(())
    }

    /// Read every blob under `node` (the node at key path `base` of checkpoint
    /// `checkpoint`), verifying each chunk, on up to `threads` threads. This
    /// is the read path of every load; a damaged chunk is an error naming
    /// the checkpoint and key.
    pub fn read_blobs(
        &self,
        checkpoint: &str,
        node: &Node,
        base: &[String],
        threads: usize,
        cancel: Cancel<'_>,
    ) -> Result<Vec<Vec<u8>>> {
        let mut blobs: Vec<(String, Blob)> = Vec::new();
        node.for_each_blob(&mut base.to_vec(), &mut |p, b| {
            blobs.push((p.join("/"), b.clone()))
        });
        // Sizes come from the manifest: a checksum-valid but hostile one may
        // claim more than any machine has, which must be an error, not an abort.
        let mut buffers: Vec<Vec<u8>> = Vec::with_capacity(blobs.len());
        for (key, b) in &blobs {
            let buf = usize::try_from(b.nbytes)
                .ok()
                .and_then(crate::staging::try_zeroed)
                .ok_or_else(|| {
                    Error::corrupt(
                        self.storage.manifest_path(checkpoint),
                        format!(
                            "key '{key}' claims {} bytes, more than can be allocated here",
                            b.nbytes
                        ),
                    )
                })?;
            buffers.push(buf);
        }
        let mut work: Vec<LoadUnit<'_>> = Vec::new();
        // A pack is read (and verified) once for all the slices wanted from it.
        let mut packs: HashMap<ChunkId, usize> = HashMap::new();
        for ((key, blob), buf) in blobs.iter().zip(buffers.iter_mut()) {
            let mut rest: &mut [u8] = buf;
            for c in &blob.chunks {
                if (c.len as usize) > rest.len() {
                    return Err(Error::corrupt(
                        self.storage.manifest_path(checkpoint),
                        format!("chunks of key '{key}' hold more bytes than its size"),
                    ));
                }
                let (head, tail) = std::mem::take(&mut rest).split_at_mut(c.len as usize);
                match c.pack {
                    None => work.push(LoadUnit::Whole(head, c.id, key.as_str())),
                    Some(p) => {
                        let i = *packs.entry(c.id).or_insert_with(|| {
                            work.push(LoadUnit::Pack(c.id, p.of, Vec::new()));
                            work.len() - 1
                        });
                        if let LoadUnit::Pack(_, of, slices) = &mut work[i] {
                            if *of != p.of {
                                return Err(Error::corrupt(
                                    self.storage.manifest_path(checkpoint),
                                    format!(
                                        "key '{key}' gives pack {} another length",
                                        c.id.to_hex()
                                    ),
                                ));
                            }
                            slices.push((head, p, key.as_str()));
                        }
                    }
                }
                rest = tail;
            }
        }
        let total = work.len();
        let queue = Mutex::new(work.into_iter());
        let failed: Mutex<Option<Error>> = Mutex::new(None);
        let run = || loop {
            if lock(&failed).is_some() {
                return;
            }
            if cancel() {
                lock(&failed).get_or_insert(Error::interrupted("load"));
                return;
            }
            let item = lock(&queue).next();
            let Some(item) = item else { return };
            if let Err(e) = self.read_into(item, checkpoint) {
                lock(&failed).get_or_insert(e);
                return;
            }
        };
        let threads = threads.clamp(1, 16).min(total.max(1));
        // Scoped threads, not a rayon pool: the work blocks on I/O (its
        // concurrency is the storage's, not the cores'), and scoped threads
        // leave nothing behind that a fork() could inherit half of.
        std::thread::scope(|s| {
            for _ in 1..threads {
                s.spawn(run);
            }
            run();
        });
        match failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some(e) => Err(e),
            None => Ok(buffers),
        }
    }

    /// One unit of a load's work: a chunk into its place, or a pack into the
    /// places of the slices wanted from it.
    fn read_into(&self, item: LoadUnit<'_>, checkpoint: &str) -> Result<()> {
        match item {
            LoadUnit::Whole(dest, id, key) => self
                .read_chunk_into(&id, dest)
                .map_err(|e| e.in_checkpoint(checkpoint, key)),
            LoadUnit::Pack(id, of, slices) => {
                let key = slices.first().map_or("", |s| s.2);
                let mut pack = usize::try_from(of)
                    .ok()
                    .and_then(crate::staging::try_zeroed)
                    .ok_or_else(|| {
                        Error::corrupt(
                            self.storage.manifest_path(checkpoint),
                            format!("key '{key}' claims a pack of {of} bytes, more than can be allocated here"),
                        )
                        .in_checkpoint(checkpoint, key)
                    })?;
                self.read_chunk_into(&id, &mut pack)
                    .map_err(|e| e.in_checkpoint(checkpoint, key))?;
                for (dest, p, key) in slices {
                    let seg = self
                        .pack_slice(&id, &pack, &p, dest.len())
                        .map_err(|e| e.in_checkpoint(checkpoint, key))?;
                    dest.copy_from_slice(seg);
                }
                Ok(())
            }
        }
    }

    /// The slice `p` (`len` bytes) of pack `id`, whose verified bytes are
    /// `pack`, once it matches its own hash (loads and `verify` alike).
    fn pack_slice<'p>(
        &self,
        id: &ChunkId,
        pack: &'p [u8],
        p: &PackSlice,
        len: usize,
    ) -> Result<&'p [u8]> {
        let at = p.at as usize;
        let seg = at
            .checked_add(len)
            .and_then(|end| pack.get(at..end))
            .filter(|seg| ChunkId::of(seg) == p.own);
        seg.ok_or_else(|| {
            Error::corrupt(
                self.storage.chunk_path(id),
                format!("the slice at {at} of this pack does not match its hash"),
            )
        })
    }

    /// Encode and store one chunk unless an identical one is already there.
    /// Returns the bytes written (0 when deduplicated).
    pub fn put_chunk(&self, raw: &[u8], id: &ChunkId) -> Result<u64> {
        if self.storage.has_chunk(id)? {
            return Ok(0);
        }
        let (codec, payload);
        let compressed;
        if self.options.codec == Codec::Zstd {
            compressed = zstd::bulk::compress(raw, self.options.zstd_level)
                .map_err(|e| Error::io(self.storage.chunk_path(id), e))?;
            // Keep the raw bytes when compression does not pay (> 97% of raw).
            if (compressed.len() as u64) * 100 < (raw.len() as u64) * 97 {
                codec = Codec::Zstd;
                payload = &compressed[..];
            } else {
                codec = Codec::Raw;
                payload = raw;
            }
        } else {
            codec = Codec::Raw;
            payload = raw;
        }
        let header = format::chunk_header(codec, raw.len() as u64);
        self.storage.put_chunk(id, &[&header, payload])?;
        Ok((CHUNK_HEADER_LEN + payload.len()) as u64)
    }

    /// Every chunk referenced by any checkpoint. A manifest that does not
    /// decode is skipped and named, its chunks kept by every id its bytes
    /// hold ([`Manifest::scan_chunk_ids`]); one that cannot be read, or is
    /// of another format version, fails the call: deleting on partial
    /// knowledge could destroy live data.
    ///
    /// `seen`: manifests read before, by name and digest of their bytes;
    /// those still the same are not read again (gc's second pass).
    fn referenced(&self, seen: Option<&HashMap<String, blake3::Hash>>) -> Result<Referenced> {
        let mut r = Referenced::default();
        // Every manifest, parts of multi-rank saves included: their chunks
        // are live until the merged manifest that references them commits.
        for name in &self.storage.list_manifests()? {
            if let Err(e) = format::validate_name(name) {
                // Not a checkpoint any tool could load or remove (put there by
                // hand): no chunk of it is protected. Named once.
                if seen.is_some() {
                    continue;
                }
                r.unreadable.push((
                    name.clone(),
                    format!(
                        "{e}; remove the file {} by hand",
                        self.storage.manifest_path(name).display()
                    ),
                ));
                continue;
            }
            let bytes = match self.storage.get_manifest(name) {
                Ok(b) => b,
                // Removed since it was listed (a concurrent `remove`, which takes
                // no lock): its chunks need no protection.
                Err(Error::NotFound { .. }) => continue,
                Err(e) => return Err(e),
            };
            let digest = blake3::hash(&bytes);
            if seen.and_then(|s| s.get(name)) == Some(&digest) {
                continue;
            }
            r.digests.insert(name.clone(), digest);
            let m = match Manifest::decode(&bytes, &self.storage.manifest_path(name)) {
                Ok(m) => m,
                Err(e) => {
                    let Some(ids) = Manifest::scan_chunk_ids(&bytes) else {
                        // Its chunks cannot be told: skipped and named, and
                        // gc keeps every chunk while it is there.
                        r.unscannable = true;
                        r.unreadable.push((
                            name.clone(),
                            format!(
                                "{e}; gc removes no chunk while it is there: `hindsight rm {name}` \
                                 removes it, or move {} aside",
                                self.storage.manifest_path(name).display()
                            ),
                        ));
                        continue;
                    };
                    for id in ids {
                        r.refs.entry(id).or_insert(0);
                    }
                    r.unreadable.push((
                        name.clone(),
                        format!("{e}; `hindsight rm {name}` removes it"),
                    ));
                    continue;
                }
            };
            r.count += 1;
            m.root.for_each_blob(&mut Vec::new(), &mut |_, b| {
                r.logical += b.nbytes;
                for c in &b.chunks {
                    r.refs.insert(c.id, c.chunk_len());
                }
            });
        }
        Ok(r)
    }

    pub fn usage(&self) -> Result<Usage> {
        let Referenced {
            count: checkpoints,
            logical: logical_bytes,
            refs,
            unreadable,
            ..
        } = self.referenced(None)?;
        let on_disk = self.storage.list_chunks()?;
        let mut stored_bytes: u64 = on_disk.iter().map(|(_, n)| n).sum();
        for name in self.list()? {
            stored_bytes += match self.storage.manifest_size(&name) {
                Ok(n) => n,
                // Removed by another process since it was listed.
                Err(Error::NotFound { .. }) => 0,
                Err(e) => return Err(e),
            };
        }
        Ok(Usage {
            checkpoints,
            logical_bytes,
            unique_bytes: refs.values().sum(),
            stored_bytes,
            chunks: on_disk.len(),
            unreferenced_chunks: on_disk
                .iter()
                .filter(|(id, _)| !refs.contains_key(id))
                .count(),
            unreadable,
        })
    }

    /// Remove chunks no checkpoint references, and stale staging files.
    ///
    /// Two passes, so that saves (which hold the shared lock from their first
    /// chunk to their commit) wait for gc only while it deletes: the first,
    /// without the lock, reads every manifest and lists the chunks none
    /// references; the second, under the exclusive lock (no save in any
    /// process is between its first chunk and its commit), reads only the
    /// manifests committed or replaced since, and spares what they
    /// reference. Chunks written since the listing are not candidates.
    pub fn gc(&self) -> Result<GcReport> {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        self.remove_stale_parts(now_ms)?;
        let first = self.referenced(None)?;
        let candidates: Vec<(ChunkId, u64)> = self
            .storage
            .list_chunks()?
            .into_iter()
            .filter(|(id, _)| !first.refs.contains_key(id))
            .collect();
        let _lock = self.storage.lock_exclusive()?;
        let since = self.referenced(Some(&first.digests))?;
        let mut report = GcReport {
            unreadable: first.unreadable,
            ..GcReport::default()
        };
        report.unreadable.extend(since.unreadable);
        let candidates = if first.unscannable || since.unscannable {
            Vec::new()
        } else {
            candidates
        };
        for (id, len) in candidates {
            if !since.refs.contains_key(&id) {
                self.storage.delete_chunk(&id)?;
                report.chunks_removed += 1;
                report.bytes_removed += len;
            }
        }
        self.storage.sync()?;
        report.staging_files_removed = self.storage.clean_staging()?;
        Ok(report)
    }

    /// Check every byte of the named checkpoints (all when `names` is empty).
    /// Each chunk is read and hashed once even when many checkpoints share it.
    pub fn verify(
        &self,
        names: &[String],
        mut progress: impl FnMut(&str),
    ) -> Result<(usize, Vec<Problem>)> {
        let names = if names.is_empty() {
            self.list()?
        } else {
            names.to_vec()
        };
        let mut problems = Vec::new();
        // Per chunk: None if intact, else what is wrong with it (the first
        // read quarantines a damaged chunk, so it is read once).
        let mut checked: HashMap<ChunkId, Option<(std::path::PathBuf, String)>> = HashMap::new();
        let mut buf = Vec::new();
        // The chunk whose verified bytes `buf` holds (a pack's slices are
        // checked against it, as a load checks them).
        let mut held: Option<ChunkId> = None;
        for name in &names {
            progress(name);
            let m = match self.manifest(name) {
                Ok(m) => m,
                Err(error) => {
                    problems.push(Problem {
                        checkpoint: Some(name.clone()),
                        error,
                    });
                    continue;
                }
            };
            // What a load refuses, verify does not call intact: the pieces
            // of a sharded array must cover it exactly once.
            if let Err(d) = crate::checkpoint::shard::check_covered(&m.root) {
                problems.push(Problem {
                    checkpoint: Some(name.clone()),
                    error: Error::corrupt(
                        self.storage.manifest_path(name),
                        format!("checkpoint '{name}' cannot be loaded: {d}"),
                    ),
                });
            }
            let mut blobs: Vec<(String, Blob)> = Vec::new();
            m.root.for_each_blob(&mut Vec::new(), &mut |p, b| {
                blobs.push((p.join("/"), b.clone()))
            });
            let mut reported = HashSet::new();
            for (key, blob) in blobs {
                for c in &blob.chunks {
                    let read = |buf: &mut Vec<u8>, held: &mut Option<ChunkId>| {
                        buf.resize(c.chunk_len() as usize, 0);
                        *held = None;
                        match self.read_chunk_into(&c.id, buf) {
                            Ok(()) => {
                                *held = Some(c.id);
                                None
                            }
                            Err(Error::Corrupt { path, detail, .. }) => Some((path, detail)),
                            Err(e) => Some((self.storage.chunk_path(&c.id), e.to_string())),
                        }
                    };
                    let result = match checked.get(&c.id) {
                        Some(r) => r.clone(),
                        None => {
                            let r = read(&mut buf, &mut held);
                            checked.insert(c.id, r.clone());
                            r
                        }
                    };
                    if let Some((path, detail)) = result {
                        if reported.insert(c.id) {
                            problems.push(Problem {
                                checkpoint: Some(name.clone()),
                                error: Error::corrupt(path, detail).in_checkpoint(name, &key),
                            });
                        }
                        continue;
                    }
                    let Some(p) = &c.pack else { continue };
                    if held != Some(c.id) {
                        if let Some((path, detail)) = read(&mut buf, &mut held) {
                            problems.push(Problem {
                                checkpoint: Some(name.clone()),
                                error: Error::corrupt(path, detail).in_checkpoint(name, &key),
                            });
                            continue;
                        }
                    }
                    if let Err(e) = self.pack_slice(&c.id, &buf, p, c.len as usize) {
                        problems.push(Problem {
                            checkpoint: Some(name.clone()),
                            error: e.in_checkpoint(name, &key),
                        });
                    }
                }
            }
        }
        Ok((names.len(), problems))
    }

    /// A tree summary of one checkpoint: (key path, kind, detail, bytes).
    pub fn describe(&self, name: &str) -> Result<(Manifest, Vec<DescribeRow>)> {
        let m = self.manifest(name)?;
        let mut rows = Vec::new();
        describe_node(&m.root, &mut Vec::new(), &mut rows);
        Ok((m, rows))
    }
}

fn check_options(o: &StoreOptions) -> Result<()> {
    if !(4096..=(1 << 30)).contains(&o.chunk_size) {
        return Err(Error::invalid(
            "chunk_size",
            format!("{} is outside 4 KiB..1 GiB", o.chunk_size),
        ));
    }
    if !(1..=22).contains(&o.zstd_level) {
        return Err(Error::invalid(
            "zstd_level",
            format!("{} is outside 1..22", o.zstd_level),
        ));
    }
    Ok(())
}

fn describe_node(node: &Node, path: &mut Vec<String>, rows: &mut Vec<(String, String, u64)>) {
    let key = if path.is_empty() {
        "/".to_string()
    } else {
        path.join("/")
    };
    match node {
        Node::Dict(items) => {
            for (k, v) in items {
                path.push(k.key_label());
                describe_node(v, path, rows);
                path.pop();
            }
            if items.is_empty() {
                rows.push((key, "dict (empty)".into(), 0));
            }
        }
        Node::List(items) | Node::Tuple(items) => {
            for (i, v) in items.iter().enumerate() {
                path.push(i.to_string());
                describe_node(v, path, rows);
                path.pop();
            }
            if items.is_empty() {
                rows.push((key, format!("{} (empty)", node.kind()), 0));
            }
        }
        Node::Array(a) => {
            let shape: Vec<String> = a.shape.iter().map(|d| d.to_string()).collect();
            let lib = match a.lib {
                format::ArrayLib::Torch => "tensor",
                format::ArrayLib::Numpy => "ndarray",
            };
            rows.push((
                key,
                format!("{lib} {}[{}]", a.dtype, shape.join(",")),
                a.data.nbytes,
            ));
        }
        Node::Sharded(sh) => {
            let shape: Vec<String> = sh.shape.iter().map(|d| d.to_string()).collect();
            let dtype = sh.shards.first().map_or("?", |p| p.array.dtype.as_str());
            rows.push((
                key,
                format!(
                    "tensor {dtype}[{}] in {} pieces",
                    shape.join(","),
                    sh.shards.len()
                ),
                sh.shards.iter().map(|p| p.array.data.nbytes).sum(),
            ));
        }
        Node::Bytes(b) => rows.push((key, "bytes".into(), b.nbytes)),
        Node::Pickle(b) => rows.push((key, "pickle".into(), b.nbytes)),
        Node::Str(s) => rows.push((key, format!("str {s:?}"), 0)),
        Node::Int(i) => rows.push((key, format!("int {i}"), 0)),
        Node::BigInt(s) => rows.push((key, format!("int {s}"), 0)),
        Node::Float(bits) => rows.push((key, format!("float {}", f64::from_bits(*bits)), 0)),
        Node::Bool(b) => rows.push((key, format!("bool {b}"), 0)),
        Node::None => rows.push((key, "None".into(), 0)),
    }
}

/// Group a manifest's blobs: key path -> blob, for partial loads.
pub fn blobs_under(node: &Node) -> BTreeMap<String, Blob> {
    let mut out = BTreeMap::new();
    node.for_each_blob(&mut Vec::new(), &mut |p, b| {
        out.insert(p.join("/"), b.clone());
    });
    out
}
