//! Where store files live. The engine talks to a [`Storage`]; every backend
//! passes the shared conformance suite in `tests/conformance.rs`.
//!
//! Local layout under the store root:
//! ```text
//! HINDSIGHT.json        store options (format version, codec, chunk size)
//! chunks/ab/abcdef...   content-addressed chunks (first two hex digits fan out)
//! manifests/NAME.hsm    committed checkpoints
//! tmp/                  staging files of in-flight writes
//! gc.lock               writers hold it shared, gc exclusive
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::Read;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::checkpoint::format::{ChunkId, Manifest};
use crate::checkpoint::layout;
use crate::durable::{self, DirSync};
use crate::error::{Error, Result};
use crate::sync::lock;

/// Name of the store options file at the root of every store.
pub const CONFIG_FILE: &str = "HINDSIGHT.json";

/// A held lock; released on drop.
pub trait LockGuard: Send + fmt::Debug {}

pub trait Storage: Send + Sync + fmt::Debug {
    /// Human-readable location, used in messages.
    fn location(&self) -> String;
    /// Path shown to users for a chunk (for error messages).
    fn chunk_path(&self, id: &ChunkId) -> PathBuf;
    fn manifest_path(&self, name: &str) -> PathBuf;

    fn has_chunk(&self, id: &ChunkId) -> Result<bool>;
    /// Store an encoded chunk file. The bytes may not be durable until [`Storage::sync`].
    fn put_chunk(&self, id: &ChunkId, parts: &[&[u8]]) -> Result<()>;
    fn open_chunk(&self, id: &ChunkId) -> Result<Box<dyn Read + Send>>;
    /// Every chunk and its encoded size on storage.
    fn list_chunks(&self) -> Result<Vec<(ChunkId, u64)>>;
    fn delete_chunk(&self, id: &ChunkId) -> Result<()>;
    /// Take a chunk whose content is damaged out of use, so the next save
    /// that has its bytes writes it again (dedup would otherwise trust it).
    /// Backends keep the damaged bytes aside where they can; the default
    /// deletes them.
    fn quarantine_chunk(&self, id: &ChunkId) -> Result<()> {
        self.delete_chunk(id)
    }
    /// Make every chunk put so far durable.
    fn sync(&self) -> Result<()>;
    /// The chunk size a new store here gets when none is asked for, where it
    /// differs from the store's default: larger where each object costs a
    /// fixed round of requests (XRootD).
    fn preferred_chunk_size(&self) -> Option<usize> {
        None
    }

    /// Atomically replace-or-create a manifest, durable on return.
    fn put_manifest(&self, name: &str, bytes: &[u8]) -> Result<()>;
    fn get_manifest(&self, name: &str) -> Result<Vec<u8>>;
    /// The name's commit now, if any that reads back (a damaged one is
    /// replaced by the next commit, so it counts as none).
    fn committed(&self, name: &str) -> Result<Option<Manifest>> {
        match self.get_manifest(name) {
            Ok(b) => Ok(Manifest::decode(&b, &self.manifest_path(name)).ok()),
            Err(Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }
    fn list_manifests(&self) -> Result<Vec<String>>;
    /// Remove a manifest durably; Ok(false) when it did not exist.
    fn delete_manifest(&self, name: &str) -> Result<bool>;
    fn manifest_size(&self, name: &str) -> Result<u64>;

    /// Held by every save from its first chunk to its commit.
    fn lock_shared(&self) -> Result<Box<dyn LockGuard>>;
    /// Held by gc; excludes all saves, in every process.
    fn lock_exclusive(&self) -> Result<Box<dyn LockGuard>>;
    /// Remove staging files left behind by crashed writers (call under the exclusive lock).
    fn clean_staging(&self) -> Result<u64>;

    /// Where the store options file lives (for messages).
    fn config_path(&self) -> PathBuf {
        PathBuf::from(self.location()).join(CONFIG_FILE)
    }
    /// The store options file; Ok(None) when the store has none yet.
    /// Backends that cannot hold one are opened with `Store::with_storage`.
    fn get_config(&self) -> Result<Option<Vec<u8>>> {
        Err(Error::invalid(
            "storage",
            format!("{} keeps no store options file", self.location()),
        ))
    }
    /// Atomically replace-or-create the store options file, durable on return.
    fn put_config(&self, _bytes: &[u8]) -> Result<()> {
        Err(Error::invalid(
            "storage",
            format!("{} keeps no store options file", self.location()),
        ))
    }
}

#[derive(Debug)]
pub struct LocalStorage {
    root: PathBuf,
    tmp: PathBuf,
    /// Directories that lost chunk names since the last sync.
    dirty_dirs: std::sync::Mutex<BTreeSet<PathBuf>>,
    /// Chunks put since the last sync: written to a staging file, published
    /// under their names by `sync` (`durable::publish_staged`). This process
    /// reads them from there meanwhile; others do not see them yet, and no
    /// manifest refers to them before `sync` returns.
    pending: std::sync::Mutex<BTreeMap<ChunkId, (PathBuf, PathBuf)>>,
    /// The process that opened the store: the two maps above are its own.
    opened_by: u32,
}

type Staged = BTreeMap<ChunkId, (PathBuf, PathBuf)>;

impl LocalStorage {
    /// Open the layout under `root`, creating its directories.
    pub fn open(root: &Path) -> Result<Self> {
        for sub in [layout::CHUNKS, layout::MANIFESTS, layout::TMP] {
            let d = root.join(sub);
            refuse_symlink(&d)?;
            crate::durable::create_dir_durable(&d)?;
        }
        Ok(LocalStorage {
            root: root.to_path_buf(),
            tmp: root.join(layout::TMP),
            dirty_dirs: Default::default(),
            pending: Default::default(),
            opened_by: std::process::id(),
        })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// This process's staged chunks. None in a process forked from the one
    /// that opened the store (a DataLoader worker reading a checkpoint): the
    /// fork may have copied the map's lock held by a writer thread that does
    /// not exist there, and waiting for it would never end; the parent's
    /// staged chunks are not the child's to read either (no manifest it can
    /// see refers to them).
    fn pending(&self) -> Option<std::sync::MutexGuard<'_, Staged>> {
        (std::process::id() == self.opened_by).then(|| lock(&self.pending))
    }

    /// A forked child's writes go through a store it opens itself.
    fn own_process(&self) -> Result<()> {
        let current = std::process::id();
        if current == self.opened_by {
            return Ok(());
        }
        Err(Error::WrongProcess {
            path: self.root.clone(),
            owner: self.opened_by,
            current,
        })
    }

    /// The path of chunk `id`, once its fan-out directory is known not to be
    /// a link: a save, read, quarantine or delete never goes through one
    /// (`ln -s /elsewhere chunks/ab` would have saves write there and a
    /// damaged chunk be moved from there into the store). One `lstat`.
    fn own_chunk_path(&self, id: &ChunkId) -> Result<PathBuf> {
        let p = self.chunk_path(id);
        refuse_symlink(p.parent().unwrap_or(&self.root))?;
        Ok(p)
    }

    fn lock(&self, exclusive: bool) -> Result<Box<dyn LockGuard>> {
        let path = self.root.join("gc.lock");
        let f = crate::forksafe::open_lock_file(&path)?;
        loop {
            // std's file locks are flock(2) on Linux: released when the file closes.
            let locked = if exclusive { f.lock() } else { f.lock_shared() };
            match locked {
                Ok(()) => {
                    // A process forked while this is held must not keep it.
                    crate::forksafe::hold(f.as_raw_fd());
                    return Ok(Box::new(FlockGuard(f)));
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(Error::io(&path, e)),
            }
        }
    }
}

/// A store never writes or deletes outside its own tree: a store directory
/// that is a symbolic link (`ln -s ~/thesis store/tmp`) is refused, so gc
/// cannot empty its target.
fn refuse_symlink(path: &Path) -> Result<()> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => Err(Error::PermissionDenied {
            path: path.to_path_buf(),
            source: std::io::Error::other(
                "is a symbolic link; a store's own directories must be real directories \
                 (it never writes or deletes outside its tree)",
            ),
        }),
        _ => Ok(()),
    }
}

/// flock is released when the file is closed.
#[derive(Debug)]
struct FlockGuard(File);
impl LockGuard for FlockGuard {}

impl Drop for FlockGuard {
    fn drop(&mut self) {
        crate::forksafe::release(self.0.as_raw_fd());
    }
}

impl Storage for LocalStorage {
    fn location(&self) -> String {
        self.root.display().to_string()
    }

    fn chunk_path(&self, id: &ChunkId) -> PathBuf {
        let (fan, file) = layout::chunk_parts(id);
        self.root.join(layout::CHUNKS).join(fan).join(file)
    }

    fn manifest_path(&self, name: &str) -> PathBuf {
        self.root
            .join(layout::MANIFESTS)
            .join(layout::manifest_file(name))
    }

    fn has_chunk(&self, id: &ChunkId) -> Result<bool> {
        if let Some(mut pending) = self.pending() {
            if let Some((staging, _)) = pending.get(id) {
                // Left pending by a failed save, its staging file may since
                // have been removed by another process's gc: not a chunk then.
                if staging.exists() {
                    return Ok(true);
                }
                pending.remove(id);
            }
        }
        let p = self.own_chunk_path(id)?;
        match fs::symlink_metadata(&p) {
            Ok(_) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(Error::io(p, e)),
        }
    }

    fn put_chunk(&self, id: &ChunkId, parts: &[&[u8]]) -> Result<()> {
        self.own_process()?;
        if lock(&self.pending).contains_key(id) {
            return Ok(());
        }
        let dest = self.own_chunk_path(id)?;
        let staging = durable::write_staged(&self.tmp, parts, &dest)?;
        if let Some((old, _)) = lock(&self.pending).insert(*id, (staging, dest)) {
            let _ = fs::remove_file(old); // put twice at once: the same bytes
        }
        Ok(())
    }

    fn open_chunk(&self, id: &ChunkId) -> Result<Box<dyn Read + Send>> {
        let staged = self
            .pending()
            .and_then(|p| p.get(id).map(|(s, _)| s.clone()));
        let p = match staged {
            Some(staging) => staging,
            None => self.own_chunk_path(id)?,
        };
        match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&p)
        {
            Ok(f) => Ok(Box::new(f)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                Err(Error::corrupt(p, "chunk file is missing"))
            }
            Err(e) => Err(Error::io(p, e)),
        }
    }

    fn quarantine_chunk(&self, id: &ChunkId) -> Result<()> {
        self.own_process()?;
        if let Some((staging, _)) = lock(&self.pending).remove(id) {
            let _ = fs::remove_file(staging); // never published: nothing refers to it
            return Ok(());
        }
        let from = self.own_chunk_path(id)?;
        let dir = self.root.join(layout::QUARANTINE);
        refuse_symlink(&dir)?;
        durable::create_dir_durable(&dir)?;
        let to = dir.join(id.to_hex());
        match fs::rename(&from, &to) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(Error::io(from, e)),
        }
        durable::sync_dir(from.parent().unwrap_or(&self.root))?;
        durable::sync_dir(&dir)
    }

    fn list_chunks(&self) -> Result<Vec<(ChunkId, u64)>> {
        let base = self.root.join(layout::CHUNKS);
        let mut out = Vec::new();
        for fan in fs::read_dir(&base).map_err(|e| Error::io(&base, e))? {
            let fan = fan.map_err(|e| Error::io(&base, e))?;
            let prefix = fan.file_name().to_string_lossy().into_owned();
            // `file_type` does not follow links: a symlinked fan-out
            // directory is not ours, and gc must not delete through it.
            if !fan
                .file_type()
                .map_err(|e| Error::io(fan.path(), e))?
                .is_dir()
            {
                continue;
            }
            for f in fs::read_dir(fan.path()).map_err(|e| Error::io(fan.path(), e))? {
                let f = f.map_err(|e| Error::io(fan.path(), e))?;
                if let Some(id) =
                    layout::chunk_from_parts(&prefix, &f.file_name().to_string_lossy())
                {
                    let len = f.metadata().map_err(|e| Error::io(f.path(), e))?.len();
                    out.push((id, len));
                }
            }
        }
        // Put by this process and not yet published: chunks it can read.
        for (id, (staging, _)) in self.pending().iter().flat_map(|p| p.iter()) {
            let len = fs::metadata(staging)
                .map_err(|e| Error::io(staging, e))?
                .len();
            out.push((*id, len));
        }
        out.sort();
        out.dedup_by_key(|(id, _)| *id);
        Ok(out)
    }

    fn delete_chunk(&self, id: &ChunkId) -> Result<()> {
        self.own_process()?;
        if let Some((staging, _)) = lock(&self.pending).remove(id) {
            let _ = fs::remove_file(staging);
        }
        let p = self.own_chunk_path(id)?;
        match fs::remove_file(&p) {
            Ok(()) => {
                self.dirty_dirs
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(p.parent().unwrap_or(&self.root).to_path_buf());
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(Error::io(p, e)),
        }
    }

    fn sync(&self) -> Result<()> {
        self.own_process()?;
        // Taken out while publishing (other saves go on putting chunks);
        // what fails to publish goes back, to be retried by the next sync.
        let (ids, mut staged): (Vec<ChunkId>, Vec<(PathBuf, PathBuf)>) =
            std::mem::take(&mut *lock(&self.pending))
                .into_iter()
                .unzip();
        let published = durable::publish_staged(&self.root, &mut staged);
        // `publish_staged` publishes from the end: the rest are the first ones.
        let mut pending = lock(&self.pending);
        for (id, files) in ids.into_iter().zip(staged) {
            // One whose staging file is gone (another process's gc) is
            // dropped: the next save writes it again instead of failing too.
            if files.0.exists() {
                pending.entry(id).or_insert(files);
            }
        }
        drop(pending);
        published?;
        let dirs = std::mem::take(&mut *self.dirty_dirs.lock().unwrap_or_else(|p| p.into_inner()));
        let r = durable::sync_dirs(&dirs);
        if r.is_err() {
            // Keep them dirty so the next sync retries.
            self.dirty_dirs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend(dirs);
        }
        r
    }

    fn put_manifest(&self, name: &str, bytes: &[u8]) -> Result<()> {
        durable::write_durable(&self.manifest_path(name), &self.tmp, &[bytes], DirSync::Now)
    }

    fn get_manifest(&self, name: &str) -> Result<Vec<u8>> {
        let p = self.manifest_path(name);
        fs::read(&p).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                Error::NotFound {
                    what: "checkpoint",
                    name: name.to_string(),
                    location: format!("store {}", self.root.display()),
                }
            } else {
                Error::io(p, e)
            }
        })
    }

    fn list_manifests(&self) -> Result<Vec<String>> {
        let dir = self.root.join(layout::MANIFESTS);
        let mut out = Vec::new();
        for e in fs::read_dir(&dir).map_err(|e| Error::io(&dir, e))? {
            let e = e.map_err(|e| Error::io(&dir, e))?;
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(stem) = layout::manifest_name(&name) {
                out.push(stem.to_string());
            }
        }
        out.sort();
        Ok(out)
    }

    fn delete_manifest(&self, name: &str) -> Result<bool> {
        durable::remove_durable(&self.manifest_path(name))
    }

    fn manifest_size(&self, name: &str) -> Result<u64> {
        let p = self.manifest_path(name);
        match fs::metadata(&p) {
            Ok(m) => Ok(m.len()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::NotFound {
                what: "checkpoint",
                name: name.into(),
                location: self.location(),
            }),
            Err(e) => Err(Error::io(p, e)),
        }
    }

    fn lock_shared(&self) -> Result<Box<dyn LockGuard>> {
        self.lock(false)
    }

    fn lock_exclusive(&self) -> Result<Box<dyn LockGuard>> {
        self.lock(true)
    }

    fn config_path(&self) -> PathBuf {
        self.root.join(CONFIG_FILE)
    }

    fn get_config(&self) -> Result<Option<Vec<u8>>> {
        let p = self.config_path();
        match fs::read(&p) {
            Ok(b) => Ok(Some(b)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(Error::io(p, e)),
        }
    }

    fn put_config(&self, bytes: &[u8]) -> Result<()> {
        durable::write_durable(&self.config_path(), &self.tmp, &[bytes], DirSync::Now)
    }

    fn clean_staging(&self) -> Result<u64> {
        refuse_symlink(&self.tmp)?; // replaced since open: still not ours to empty
                                    // Under the exclusive lock no save is in flight: what is still
                                    // pending here belongs to a save that failed before its commit.
        self.own_process()?;
        lock(&self.pending).clear();
        let mut n = 0;
        for e in fs::read_dir(&self.tmp).map_err(|e| Error::io(&self.tmp, e))? {
            let e = e.map_err(|e| Error::io(&self.tmp, e))?;
            if fs::remove_file(e.path()).is_ok() {
                n += 1;
            }
        }
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child forked while the store is locked does not keep the lock: the
    /// parent's gc got an exclusive lock only once a DataLoader worker forked
    /// during a save had exited (at interpreter exit: a hang).
    #[test]
    fn a_forked_child_does_not_keep_the_stores_lock() {
        let dir = tempfile::tempdir().unwrap();
        let s = LocalStorage::open(dir.path()).unwrap();
        let shared = s.lock_shared().unwrap();
        let mut ready = [0i32; 2];
        // SAFETY: a plain pipe; the child only writes, sleeps and leaves
        // (async-signal-safe calls), after the fork handlers ran.
        let pid = unsafe {
            assert_eq!(libc::pipe(ready.as_mut_ptr()), 0);
            libc::fork()
        };
        assert!(pid >= 0);
        if pid == 0 {
            unsafe {
                libc::write(ready[1], b"x".as_ptr().cast(), 1);
                libc::sleep(5);
                libc::_exit(0);
            }
        }
        let mut byte = 0u8;
        // SAFETY: reading one byte the child writes once it runs.
        unsafe {
            assert_eq!(libc::read(ready[0], (&mut byte as *mut u8).cast(), 1), 1);
            libc::close(ready[0]);
            libc::close(ready[1]);
        }
        drop(shared);
        let probe = File::open(dir.path().join("gc.lock")).unwrap();
        let free = probe.try_lock();
        // SAFETY: reaping our own child.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
        }
        assert!(
            free.is_ok(),
            "the child still holds the store's lock: {free:?}"
        );
    }

    /// A DataLoader worker forked while the writer thread held the staged
    /// chunks' lock reads a published checkpoint without waiting for that
    /// lock (its owner does not exist in the child: it waited forever, a
    /// flaky hang of test_processes), and refuses to write through the
    /// parent's store.
    #[test]
    fn a_forked_child_reads_without_the_parents_locks_and_does_not_write() {
        let dir = tempfile::tempdir().unwrap();
        let s = LocalStorage::open(dir.path()).unwrap();
        let id = ChunkId::of(b"published");
        s.put_chunk(&id, &[b"published"]).unwrap();
        s.sync().unwrap();
        let held = lock(&s.pending); // as a writer thread holds it at the fork
                                     // SAFETY: the child only reads a file, then leaves with _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            let mut buf = Vec::new();
            let read = s.open_chunk(&id).and_then(|mut r| {
                r.read_to_end(&mut buf)
                    .map_err(|e| Error::io(dir.path(), e))
            });
            let ok = read.is_ok()
                && buf == b"published"
                && s.has_chunk(&id).unwrap_or(false)
                && matches!(
                    s.put_chunk(&ChunkId::of(b"x"), &[b"x"]),
                    Err(Error::WrongProcess { .. })
                );
            // SAFETY: leaving the child without running the parent's destructors.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        // SAFETY: reaping our own child, killed if it hangs.
        let done = loop {
            let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if r == pid {
                break true;
            }
            if std::time::Instant::now() > deadline {
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, &mut status, 0);
                }
                break false;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        drop(held);
        assert!(done, "the forked child hung on the parent's lock");
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "status {status}"
        );
    }

    fn names_under(dir: &Path) -> usize {
        fs::read_dir(dir)
            .map(|d| {
                d.flatten()
                    .map(|e| {
                        if e.path().is_dir() {
                            names_under(&e.path())
                        } else {
                            1
                        }
                    })
                    .sum()
            })
            .unwrap_or(0)
    }

    #[test]
    fn chunks_are_published_together_and_never_under_their_name_before_they_are_durable() {
        let dir = tempfile::tempdir().unwrap();
        let s = LocalStorage::open(dir.path()).unwrap();
        let ids: Vec<ChunkId> = (0..20u8)
            .map(|i| {
                let raw = vec![i; 100 + i as usize];
                let id = ChunkId::of(&raw);
                s.put_chunk(&id, &[&raw]).unwrap();
                id
            })
            .collect();
        // Readable here at once; under no final name yet.
        assert!(s.has_chunk(&ids[3]).unwrap());
        let mut got = Vec::new();
        s.open_chunk(&ids[3])
            .unwrap()
            .read_to_end(&mut got)
            .unwrap();
        assert_eq!(got, vec![3u8; 103]);
        assert_eq!(s.list_chunks().unwrap().len(), 20);
        assert_eq!(names_under(&dir.path().join(layout::CHUNKS)), 0);
        let other = LocalStorage::open(dir.path()).unwrap();
        assert!(!other.has_chunk(&ids[3]).unwrap());
        // A crash now (nothing synced) leaves only staging files, which gc removes.
        s.sync().unwrap();
        assert_eq!(names_under(&dir.path().join(layout::CHUNKS)), 20);
        assert_eq!(names_under(&dir.path().join(layout::TMP)), 0);
        for id in &ids {
            assert!(other.has_chunk(id).unwrap());
        }
        // A small batch goes file by file, with the same result.
        let raw = b"one more".to_vec();
        let id = ChunkId::of(&raw);
        s.put_chunk(&id, &[&raw]).unwrap();
        s.sync().unwrap();
        assert!(other.has_chunk(&id).unwrap());
        assert_eq!(names_under(&dir.path().join(layout::TMP)), 0);
    }

    #[test]
    fn a_pending_chunk_whose_staging_file_another_gc_removed_is_written_again() {
        let dir = tempfile::tempdir().unwrap();
        let s = LocalStorage::open(dir.path()).unwrap();
        let raw = vec![9u8; 512];
        let id = ChunkId::of(&raw);
        s.put_chunk(&id, &[&raw]).unwrap();
        // Another process's gc (this save failed and let go of the lock).
        let other = LocalStorage::open(dir.path()).unwrap();
        assert_eq!(other.clean_staging().unwrap(), 1);
        // Not taken for present: the next save writes it, and it is published.
        assert!(!s.has_chunk(&id).unwrap());
        s.put_chunk(&id, &[&raw]).unwrap();
        s.sync().unwrap();
        assert!(other.has_chunk(&id).unwrap());
        // A sync that finds a staging file gone fails once, then goes on.
        let raw2 = vec![8u8; 512];
        let id2 = ChunkId::of(&raw2);
        s.put_chunk(&id2, &[&raw2]).unwrap();
        assert_eq!(other.clean_staging().unwrap(), 1);
        assert!(s.sync().is_err());
        s.sync().unwrap();
        assert!(!s.has_chunk(&id2).unwrap());
    }

    #[test]
    fn a_save_that_never_synced_leaves_nothing_gc_keeps() {
        let dir = tempfile::tempdir().unwrap();
        let s = LocalStorage::open(dir.path()).unwrap();
        let raw = vec![7u8; 4096];
        let id = ChunkId::of(&raw);
        s.put_chunk(&id, &[&raw]).unwrap();
        let _g = s.lock_exclusive().unwrap();
        assert_eq!(s.clean_staging().unwrap(), 1);
        assert!(
            !s.has_chunk(&id).unwrap(),
            "a cleaned staging file is not a chunk"
        );
        s.sync().unwrap();
        assert_eq!(names_under(&dir.path().join(layout::CHUNKS)), 0);
    }
}
