//! One process holds a run at a time: two launches of one command that both
//! find the same interrupted run would both resume it, and write one run's
//! checkpoints and values twice. The holder keeps an exclusive `flock(2)` on
//! `<home>/locks/<run>.lock` for its life (the kernel drops it when the
//! process ends, however it ends), with its pid and host written inside for
//! the refusal to name.

use std::fs::{File, TryLockError};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// The directory of a home that holds the run locks.
pub const LOCKS_DIR: &str = "locks";

/// A run held by this process until dropped.
#[derive(Debug)]
pub struct RunLease {
    file: File,
    path: PathBuf,
}

impl RunLease {
    /// Hold run `run_id` of the project home `home`, or refuse naming the
    /// process that holds it.
    pub fn hold(home: &Path, run_id: &str) -> Result<RunLease> {
        if run_id.is_empty() || run_id.contains(['/', '\0']) || run_id.starts_with('.') {
            return Err(Error::invalid(
                "run id",
                format!("{run_id:?} cannot name a lock file"),
            ));
        }
        let dir = home.join(LOCKS_DIR);
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        let path = dir.join(format!("{run_id}.lock"));
        let mut file = crate::forksafe::open_lock_file(&path)?;
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                return Err(Error::Replay {
                    what: "resume".into(),
                    run: run_id.into(),
                    detail: format!(
                        "the run is held by another process ({}): a second launch of the same command? \
                         Wait for it to end, or stop it, then launch again",
                        if holder.is_empty() { "unknown" } else { holder }
                    ),
                });
            }
            Err(TryLockError::Error(e)) => return Err(Error::io(&path, e)),
        }
        // A forked child (a DataLoader worker) must not keep the run held.
        crate::forksafe::hold(file.as_raw_fd());
        let me = format!(
            "pid {} on host {}",
            std::process::id(),
            crate::runs::resume::Here::current().host
        );
        file.set_len(0)
            .and_then(|()| file.rewind())
            .and_then(|()| file.write_all(me.as_bytes()))
            .map_err(|e| Error::io(&path, e))?;
        Ok(RunLease { file, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for RunLease {
    fn drop(&mut self) {
        crate::forksafe::release(self.file.as_raw_fd());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_run_is_refused_to_another_holder_naming_the_first_and_free_again_after() {
        let home = tempfile::tempdir().unwrap();
        let first = RunLease::hold(home.path(), "r1").unwrap();
        let err = RunLease::hold(home.path(), "r1").unwrap_err().to_string();
        assert!(
            err.contains(&format!("pid {}", std::process::id())),
            "{err}"
        );
        assert!(err.contains("resume of run r1"), "{err}");
        // Another run is another lock.
        let other = RunLease::hold(home.path(), "r2").unwrap();
        drop(first);
        let again = RunLease::hold(home.path(), "r1").unwrap();
        assert!(again.path().ends_with("locks/r1.lock"));
        drop((other, again));
        assert!(RunLease::hold(home.path(), "../x").is_err());
    }
}
