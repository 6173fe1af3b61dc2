//! The one way hindsight makes bytes durable on a file system: write a staging
//! file in the store's `tmp/` directory, fsync it, rename it over the final
//! name, then fsync the directory that now holds the name. A crash at any
//! instant leaves either the old file or the complete new one, never a torn one.
//!
//! Writers that commit many files at once (the chunks of one checkpoint) may
//! defer the directory fsync and do it once per directory with [`sync_dirs`]
//! before anything that refers to those files is committed; or stage the
//! files with [`write_staged`] and publish them together with
//! [`publish_staged`]: the same guarantee, for two file-system syncs instead
//! of an fsync per file and per directory (a checkpoint of many small
//! tensors has hundreds of chunk files).

use std::collections::BTreeSet;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};

/// When the directory holding the new name is fsynced.
#[derive(Debug)]
pub enum DirSync<'a> {
    /// Before returning.
    Now,
    /// Later, by the caller, via [`sync_dirs`] on the collected set.
    Deferred(&'a mut BTreeSet<PathBuf>),
}

static STAGING_SEQ: AtomicU64 = AtomicU64::new(0);

/// A staging name unique across processes and threads of this host.
fn staging_name() -> String {
    let seq = STAGING_SEQ.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{}-{seq}-{nanos}.tmp", std::process::id())
}

/// Write `parts` (concatenated) to `dest` durably and atomically.
/// `tmp_dir` must be on the same file system as `dest`.
pub fn write_durable(
    dest: &Path,
    tmp_dir: &Path,
    parts: &[&[u8]],
    dir_sync: DirSync<'_>,
) -> Result<()> {
    let staging = write_staged(tmp_dir, parts, dest)?;
    let result = (|| {
        let f = File::open(&staging).map_err(|e| Error::io(dest, e))?;
        f.sync_all().map_err(|e| Error::io(dest, e))?;
        drop(f);
        let created = match dest.parent() {
            Some(parent) => create_dirs(parent)?,
            None => Vec::new(),
        };
        fs::rename(&staging, dest).map_err(|e| Error::io(dest, e))?;
        Ok(created)
    })();
    let created = match result {
        Ok(c) => c,
        Err(e) => {
            // Best effort: a leftover staging file is harmless (gc removes it) but wasteful.
            let _ = fs::remove_file(&staging);
            return Err(e);
        }
    };
    // The new name, and the entry of every directory created for it.
    let parent = dest.parent().unwrap_or(Path::new("."));
    let dirs = std::iter::once(parent.to_path_buf()).chain(created);
    match dir_sync {
        DirSync::Now => dirs.into_iter().try_for_each(|d| sync_dir(&d)),
        DirSync::Deferred(set) => {
            set.extend(dirs);
            Ok(())
        }
    }
}

/// Write `parts` (concatenated) to a new staging file in `tmp_dir`, not yet
/// durable and under no final name: the first half of [`publish_staged`].
/// `dest` names the file in errors (that is what the user knows about).
pub fn write_staged(tmp_dir: &Path, parts: &[&[u8]], dest: &Path) -> Result<PathBuf> {
    let staging = tmp_dir.join(staging_name());
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&staging)
            .map_err(|e| Error::io(&staging, e))?;
        // Name the destination: that is what the user knows about.
        for p in parts {
            f.write_all(p).map_err(|e| Error::io(dest, e))?;
        }
        Ok(())
    })();
    if let Err(e) = result {
        let _ = fs::remove_file(&staging);
        return Err(e);
    }
    Ok(staging)
}

/// Batches smaller than this are published file by file (an fsync each): a
/// whole-file-system sync also flushes what other programs wrote.
const SYNCFS_FROM: usize = 8;

/// Publish files staged by [`write_staged`] (pairs of staging file and
/// destination, all on the file system of `root`): make their bytes durable,
/// rename each over its destination, make the new names durable. A crash at
/// any instant leaves every destination absent or complete. Published pairs
/// are drained from `files`; on an error the rest stay, to be retried.
pub fn publish_staged(root: &Path, files: &mut Vec<(PathBuf, PathBuf)>) -> Result<()> {
    if files.is_empty() {
        return Ok(());
    }
    let batch = files.len() >= SYNCFS_FROM;
    if batch {
        sync_filesystem(root)?;
    } else {
        for (staging, dest) in files.iter() {
            let f = File::open(staging).map_err(|e| Error::io(dest, e))?;
            f.sync_all().map_err(|e| Error::io(dest, e))?;
        }
    }
    let mut dirs = BTreeSet::new();
    while let Some((staging, dest)) = files.last().cloned() {
        if let Some(parent) = dest.parent() {
            dirs.extend(create_dirs(parent)?);
            dirs.insert(parent.to_path_buf());
        }
        fs::rename(&staging, &dest).map_err(|e| Error::io(&dest, e))?;
        files.pop();
    }
    if batch {
        sync_filesystem(root)
    } else {
        sync_dirs(&dirs)
    }
}

/// `syncfs(2)` on the file system holding `path`: every dirty page and
/// inode of it reaches the disk.
fn sync_filesystem(path: &Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    let f = File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: a plain syscall on a descriptor this frame owns.
    if unsafe { libc::syncfs(f.as_raw_fd()) } != 0 {
        return Err(Error::io(path, std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Create `dir` and its missing ancestors; returns the directories whose
/// entries changed (the parent of each one created), which must be fsynced
/// for the new directories to survive a crash.
fn create_dirs(dir: &Path) -> Result<Vec<PathBuf>> {
    if dir.as_os_str().is_empty() || dir.is_dir() {
        return Ok(Vec::new());
    }
    let mut missing = Vec::new();
    let mut d = dir;
    while !d.as_os_str().is_empty() && !d.exists() {
        missing.push(d);
        match d.parent() {
            Some(p) => d = p,
            None => break,
        }
    }
    let mut changed = Vec::new();
    for m in missing.into_iter().rev() {
        match fs::create_dir(m) {
            Ok(()) => changed.extend(
                m.parent()
                    .filter(|p| !p.as_os_str().is_empty())
                    .map(Path::to_path_buf),
            ),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && m.is_dir() => {}
            Err(e) => return Err(Error::io(m, e)),
        }
    }
    Ok(changed)
}

/// Create `dir` and its missing ancestors durably: once this returns, a
/// crash cannot lose any of them.
pub fn create_dir_durable(dir: &Path) -> Result<()> {
    create_dirs(dir)?.iter().try_for_each(|d| sync_dir(d))
}

/// fsync one directory so the names it holds survive a crash.
pub fn sync_dir(dir: &Path) -> Result<()> {
    let f = File::open(dir).map_err(|e| Error::io(dir, e))?;
    f.sync_all().map_err(|e| Error::io(dir, e))
}

pub fn sync_dirs(dirs: &BTreeSet<PathBuf>) -> Result<()> {
    dirs.iter().try_for_each(|d| sync_dir(d))
}

/// Remove a file durably (the removal survives a crash once this returns).
/// A file that is already gone is not an error: removal is idempotent.
pub fn remove_durable(path: &Path) -> Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => {
            sync_dir(path.parent().unwrap_or(Path::new(".")))?;
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io(path, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_replaces_atomically_and_leaves_no_staging_file() {
        let dir = tempfile::tempdir().unwrap();
        let tmp = dir.path().join("tmp");
        fs::create_dir(&tmp).unwrap();
        let dest = dir.path().join("a/b/file");
        write_durable(&dest, &tmp, &[b"hello ", b"world"], DirSync::Now).unwrap();
        assert_eq!(fs::read(&dest).unwrap(), b"hello world");
        write_durable(&dest, &tmp, &[b"v2"], DirSync::Now).unwrap();
        assert_eq!(fs::read(&dest).unwrap(), b"v2");
        assert_eq!(fs::read_dir(&tmp).unwrap().count(), 0);
    }

    #[test]
    fn every_directory_created_for_a_name_is_synced() {
        let dir = tempfile::tempdir().unwrap();
        let tmp = dir.path().join("tmp");
        fs::create_dir(&tmp).unwrap();
        let mut dirs = BTreeSet::new();
        let dest = dir.path().join("chunks/ab/cd/file");
        write_durable(&dest, &tmp, &[b"x"], DirSync::Deferred(&mut dirs)).unwrap();
        // The name's directory, and each new directory's entry in its parent.
        let want: BTreeSet<PathBuf> = ["", "chunks", "chunks/ab", "chunks/ab/cd"]
            .iter()
            .map(|d| dir.path().join(d).components().collect())
            .collect();
        let got: BTreeSet<PathBuf> = dirs.iter().map(|d| d.components().collect()).collect();
        assert_eq!(got, want);
        // A second name in the same place creates nothing new.
        let mut again = BTreeSet::new();
        write_durable(
            &dir.path().join("chunks/ab/cd/other"),
            &tmp,
            &[b"y"],
            DirSync::Deferred(&mut again),
        )
        .unwrap();
        assert_eq!(again.len(), 1);
        sync_dirs(&dirs).unwrap();
    }

    #[test]
    fn failed_write_names_the_path_and_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let missing_tmp = dir.path().join("no-such-tmp");
        let err =
            write_durable(&dir.path().join("x"), &missing_tmp, &[b"x"], DirSync::Now).unwrap_err();
        assert!(err.to_string().contains("no-such-tmp"), "{err}");
        assert!(!dir.path().join("x").exists());
    }
}
