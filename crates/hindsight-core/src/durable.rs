//! The one way hindsight makes bytes durable on a file system: write a staging
//! file in the store's `tmp/` directory, fsync it, rename it over the final
//! name, then fsync the directory that now holds the name. A crash at any
//! instant leaves either the old file or the complete new one, never a torn one.
//!
//! Writers that commit many files at once (the chunks of one checkpoint) may
//! defer the directory fsync and do it once per directory with [`sync_dirs`]
//! before anything that refers to those files is committed.

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
        f.sync_all().map_err(|e| Error::io(dest, e))?;
        drop(f);
        if let Some(parent) = dest.parent() {
            fs::create_dir_all(parent).map_err(|e| Error::io(parent, e))?;
        }
        fs::rename(&staging, dest).map_err(|e| Error::io(dest, e))
    })();
    if result.is_err() {
        // Best effort: a leftover staging file is harmless (gc removes it) but wasteful.
        let _ = fs::remove_file(&staging);
        return result;
    }
    let parent = dest.parent().unwrap_or(Path::new("."));
    match dir_sync {
        DirSync::Now => sync_dir(parent),
        DirSync::Deferred(set) => {
            set.insert(parent.to_path_buf());
            Ok(())
        }
    }
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
    fn failed_write_names_the_path_and_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let missing_tmp = dir.path().join("no-such-tmp");
        let err =
            write_durable(&dir.path().join("x"), &missing_tmp, &[b"x"], DirSync::Now).unwrap_err();
        assert!(err.to_string().contains("no-such-tmp"), "{err}");
        assert!(!dir.path().join("x").exists());
    }
}
