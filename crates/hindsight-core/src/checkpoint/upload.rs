//! Local-first checkpoints: a save commits to a fast local store, and an
//! [`Uploader`] thread then copies each committed checkpoint to its
//! destination (usually object storage), chunks first and the manifest last,
//! so the destination's atomic-commit rule holds there too. The training
//! thread is never held up by the network; `flush` waits for the uploads.
//!
//! Chunks are copied as stored (encoded, checksummed); the destination's
//! readers verify them as they would any chunk.

use std::collections::{HashSet, VecDeque};
use std::io::Read;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::checkpoint::format::{ChunkId, Manifest};
use crate::checkpoint::store::Store;
use crate::error::{Error, Result};
use crate::sync::lock;

/// Parallel transfers per checkpoint: object stores reward concurrency
/// (each request has latency), local copies do not mind it.
const TRANSFER_THREADS: usize = 8;

/// What one copy did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CopyStats {
    pub chunks_copied: usize,
    pub chunks_present: usize,
    pub bytes_copied: u64,
}

/// Copy checkpoint `name` from `from` to `to`: every chunk the destination
/// lacks, then the manifest. Both stores' shared locks are held throughout,
/// so neither side's gc can remove a chunk mid-copy. Returns `Ok(None)` when
/// `from` no longer has the checkpoint (it was removed meanwhile).
pub fn copy_checkpoint(from: &Store, to: &Store, name: &str) -> Result<Option<CopyStats>> {
    crate::checkpoint::format::validate_name(name)?;
    let _from_lock = from.storage().lock_shared()?;
    let bytes = match from.storage().get_manifest(name) {
        Ok(b) => b,
        Err(Error::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(e),
    };
    let manifest = Manifest::decode(&bytes, &from.storage().manifest_path(name))?;
    let mut ids: Vec<ChunkId> = Vec::new();
    let mut seen = HashSet::new();
    manifest.root.for_each_blob(&mut Vec::new(), &mut |_, b| {
        ids.extend(b.chunks.iter().map(|c| c.id).filter(|id| seen.insert(*id)));
    });
    let _to_lock = to.storage().lock_shared()?;
    let next = AtomicUsize::new(0);
    let results: Vec<Result<CopyStats>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..TRANSFER_THREADS.min(ids.len()).max(1))
            .map(|_| {
                s.spawn(|| {
                    let mut st = CopyStats::default();
                    let mut buf = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(id) = ids.get(i) else {
                            return Ok(st);
                        };
                        if to.storage().has_chunk(id)? {
                            st.chunks_present += 1;
                            continue;
                        }
                        buf.clear();
                        from.storage()
                            .open_chunk(id)?
                            .read_to_end(&mut buf)
                            .map_err(|e| Error::io(from.storage().chunk_path(id), e))?;
                        to.storage().put_chunk(id, &[&buf])?;
                        st.chunks_copied += 1;
                        st.bytes_copied += buf.len() as u64;
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join()
                    .unwrap_or_else(|_| Err(Error::internal("the upload thread panicked")))
            })
            .collect()
    });
    let mut total = CopyStats::default();
    for r in results {
        let st = r?;
        total.chunks_copied += st.chunks_copied;
        total.chunks_present += st.chunks_present;
        total.bytes_copied += st.bytes_copied;
    }
    to.storage().sync()?;
    to.storage().put_manifest(name, &bytes)?;
    total.bytes_copied += bytes.len() as u64;
    Ok(Some(total))
}

#[derive(Debug, Default)]
struct State {
    queue: VecDeque<String>,
    /// The checkpoint being copied now.
    current: Option<String>,
    closed: bool,
    /// Failures nobody has seen yet: (checkpoint, error).
    errors: Vec<(String, Arc<Error>)>,
    uploaded: u64,
}

#[derive(Debug)]
struct Shared {
    local: Arc<Store>,
    remote: Arc<Store>,
    state: Mutex<State>,
    cv: Condvar,
}

/// Copies committed checkpoints from a local store to their destination on
/// one background thread, in commit order.
#[derive(Debug)]
pub struct Uploader {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    owner_pid: u32,
}

impl Uploader {
    /// Start the uploader. Checkpoints complete in `local` but missing from
    /// `remote` (a previous process was killed before uploading them) are
    /// queued first, oldest name first.
    pub fn new(local: Arc<Store>, remote: Arc<Store>) -> Result<Uploader> {
        let there: HashSet<String> = remote.list()?.into_iter().collect();
        let missing: VecDeque<String> = local
            .list()?
            .into_iter()
            .filter(|n| !there.contains(n))
            .collect();
        let shared = Arc::new(Shared {
            local,
            remote,
            state: Mutex::new(State {
                queue: missing,
                ..State::default()
            }),
            cv: Condvar::new(),
        });
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("hindsight-upload".into())
            .spawn(move || upload_loop(&sh))
            .map_err(|e| Error::io("<thread>", e))?;
        Ok(Uploader {
            shared,
            thread: Some(thread),
            owner_pid: std::process::id(),
        })
    }

    pub fn local(&self) -> &Arc<Store> {
        &self.shared.local
    }

    pub fn remote(&self) -> &Arc<Store> {
        &self.shared.remote
    }

    /// Queue a checkpoint that is now complete in the local store.
    pub fn enqueue(&self, name: &str) {
        let mut st = lock(&self.shared.state);
        if !st.queue.iter().any(|n| n == name) {
            st.queue.push_back(name.to_string());
        }
        drop(st);
        self.shared.cv.notify_all();
    }

    /// Drop `name` from the queue and wait out its copy if one is running,
    /// so that removing it from the destination afterwards is final.
    pub fn forget(&self, name: &str) {
        let mut st = lock(&self.shared.state);
        st.queue.retain(|n| n != name);
        while st.current.as_deref() == Some(name) {
            st = self.shared.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Checkpoints queued or being copied.
    pub fn pending(&self) -> usize {
        let st = lock(&self.shared.state);
        st.queue.len() + usize::from(st.current.is_some())
    }

    /// Checkpoints copied so far by this uploader.
    pub fn uploaded(&self) -> u64 {
        lock(&self.shared.state).uploaded
    }

    /// Wait until nothing is queued or being copied; `Ok(false)` on timeout.
    /// Reports (and forgets) the failures so far, the first in full.
    pub fn flush_timeout(&self, timeout: Option<Duration>) -> Result<bool> {
        let deadline = timeout.map(|t| Instant::now() + t);
        let mut st = lock(&self.shared.state);
        while !st.queue.is_empty() || st.current.is_some() {
            if !st.errors.is_empty() {
                break; // report now: the queue stops at a failure
            }
            st = match deadline {
                None => self.shared.cv.wait(st).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return Ok(false);
                    }
                    self.shared
                        .cv
                        .wait_timeout(st, d - now)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
            };
        }
        drop(st);
        self.take_error()?;
        Ok(true)
    }

    /// Report (and forget) the failures so far.
    pub fn take_error(&self) -> Result<()> {
        let all: Vec<_> = lock(&self.shared.state).errors.drain(..).collect();
        let Some((name, first)) = all.first() else {
            return Ok(());
        };
        let more = if all.len() > 1 {
            format!(" (and {} later uploads failed too)", all.len() - 1)
        } else {
            String::new()
        };
        Err(Error::Background {
            checkpoint: format!("{name}: upload to {}{more}", self.shared.remote.location()),
            source: first.clone(),
        })
    }
}

fn upload_loop(shared: &Shared) {
    loop {
        let name = {
            let mut st = lock(&shared.state);
            loop {
                // After a failure the queue waits until someone has seen it, then
                // goes on: the failed checkpoint stays local (a later process
                // uploads it), later ones still get their chance.
                if st.errors.is_empty() {
                    if let Some(n) = st.queue.pop_front() {
                        st.current = Some(n.clone());
                        break n;
                    }
                    if st.closed {
                        return;
                    }
                } else if st.closed {
                    return;
                }
                st = shared.cv.wait(st).unwrap_or_else(|p| p.into_inner());
            }
        };
        let r = copy_checkpoint(&shared.local, &shared.remote, &name);
        let mut st = lock(&shared.state);
        match r {
            Ok(Some(_)) => st.uploaded += 1,
            Ok(None) => {}
            Err(e) => st.errors.push((name, Arc::new(e))),
        }
        st.current = None;
        drop(st);
        shared.cv.notify_all();
    }
}

impl Drop for Uploader {
    fn drop(&mut self) {
        if std::process::id() != self.owner_pid {
            // A forked child has no uploader thread: leak, as the writer does.
            std::mem::forget(self.shared.clone());
            std::mem::forget(self.thread.take());
            return;
        }
        // Finish the queue (a clean exit means uploaded), unless it is stuck on a failure.
        lock(&self.shared.state).closed = true;
        self.shared.cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::writer::{Writer, WriterOptions};
    use crate::Node;
    use std::collections::BTreeMap;

    fn stores() -> (tempfile::TempDir, Arc<Store>, Arc<Store>) {
        let dir = tempfile::tempdir().unwrap();
        let local = Store::open_local(&dir.path().join("local"), true, None).unwrap();
        let remote = Store::open_local(&dir.path().join("remote"), true, None).unwrap();
        (dir, Arc::new(local), Arc::new(remote))
    }

    fn save(w: &Writer, name: &str, data: &[u8]) {
        let mut b = w.begin(name).unwrap();
        let blob = b.stage(data).unwrap();
        let root = Node::Dict(vec![(Node::Str("x".into()), Node::Bytes(blob))]);
        b.commit(root, BTreeMap::new()).wait().unwrap();
    }

    #[test]
    fn copy_is_complete_and_skips_present_chunks() {
        let (_d, local, remote) = stores();
        let w = Writer::new(local.clone(), WriterOptions::default()).unwrap();
        let data: Vec<u8> = (0..(9u32 << 20)).map(|i| (i * 7 % 251) as u8).collect();
        save(&w, "a", &data);
        save(&w, "b", &data);
        let first = copy_checkpoint(&local, &remote, "a").unwrap().unwrap();
        assert_eq!((first.chunks_copied, first.chunks_present), (3, 0));
        let second = copy_checkpoint(&local, &remote, "b").unwrap().unwrap();
        assert_eq!((second.chunks_copied, second.chunks_present), (0, 3));
        assert_eq!(remote.list().unwrap(), vec!["a", "b"]);
        let (n, problems) = remote.verify(&[], |_| {}).unwrap();
        assert_eq!((n, problems.len()), (2, 0));
        assert_eq!(copy_checkpoint(&local, &remote, "gone").unwrap(), None);
    }

    #[test]
    fn uploader_catches_up_and_flush_waits() {
        let (_d, local, remote) = stores();
        let w = Writer::new(local.clone(), WriterOptions::default()).unwrap();
        save(&w, "old", b"left behind by a killed process");
        let up = Uploader::new(local.clone(), remote.clone()).unwrap();
        save(&w, "new", b"fresh");
        up.enqueue("new");
        assert!(up.flush_timeout(None).unwrap());
        assert_eq!(remote.list().unwrap(), vec!["new", "old"]);
        assert_eq!((up.pending(), up.uploaded()), (0, 2));
    }

    #[test]
    fn failure_surfaces_at_flush_and_names_the_destination() {
        let (d, local, remote) = stores();
        let w = Writer::new(local.clone(), WriterOptions::default()).unwrap();
        save(&w, "a", b"some bytes");
        let up = Uploader::new(local.clone(), remote.clone()).unwrap();
        up.flush_timeout(None).unwrap();
        // Make the destination unwritable: a file where the manifests directory was.
        std::fs::remove_dir_all(d.path().join("remote/manifests")).unwrap();
        std::fs::write(d.path().join("remote/manifests"), b"").unwrap();
        save(&w, "b", b"other bytes");
        up.enqueue("b");
        let e = up.flush_timeout(None).unwrap_err().to_string();
        assert!(e.contains("b: upload to") && e.contains("remote"), "{e}");
        // Reported once; the checkpoint is still complete locally.
        up.flush_timeout(None).unwrap();
        assert_eq!(local.list().unwrap(), vec!["a", "b"]);
    }
}
