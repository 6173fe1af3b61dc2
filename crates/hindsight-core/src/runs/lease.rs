//! One process holds a run at a time: two launches of one command that both
//! find the same interrupted run would both resume it, and write one run's
//! checkpoints and values twice. The holder keeps an exclusive `flock(2)` on
//! `<home>/locks/<run>.lock` for its life (the kernel drops it when the
//! process ends, however it ends), with its pid and host written inside for
//! the refusal to name.
//!
//! A replay reads the run (its rows, its checkpoints) and holds the same
//! file shared, beside other replays: `rm` then refuses to take the run or
//! its checkpoints from under it ([`holder`]).

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
        let path = lock_path(home, run_id)?;
        let dir = home.join(LOCKS_DIR);
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
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

    /// Hold run `run_id` shared, for a replay of it. `None` where a process
    /// holds it exclusively (a recording or a resume under way): the replay
    /// goes on without the hold, as before.
    pub fn share(home: &Path, run_id: &str) -> Result<Option<RunLease>> {
        let path = lock_path(home, run_id)?;
        let dir = home.join(LOCKS_DIR);
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        let file = crate::forksafe::open_lock_file(&path)?;
        match file.try_lock_shared() {
            Ok(()) => {
                crate::forksafe::hold(file.as_raw_fd());
                Ok(Some(RunLease { file, path }))
            }
            Err(TryLockError::WouldBlock) => Ok(None),
            Err(TryLockError::Error(e)) => Err(Error::io(&path, e)),
        }
    }
}

/// Who holds a run now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Holder {
    /// A recording or resume (its pid and host, as it wrote them).
    Recording(String),
    /// One or more replays.
    Replays,
}

/// Who holds run `run_id` of the project home `home`, if anyone (it is not
/// held then, and nothing is left held).
pub fn holder(home: &Path, run_id: &str) -> Result<Option<Holder>> {
    // A name no lock file can have is held by no one.
    let Ok(path) = lock_path(home, run_id) else {
        return Ok(None);
    };
    let mut file = match std::fs::File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(&path, e)),
    };
    let held = |r: std::result::Result<(), TryLockError>| match r {
        Ok(()) => Ok(false),
        Err(TryLockError::WouldBlock) => Ok(true),
        Err(TryLockError::Error(e)) => Err(Error::io(&path, e)),
    };
    if !held(file.try_lock())? {
        let _ = file.unlock();
        return Ok(None);
    }
    if !held(file.try_lock_shared())? {
        let _ = file.unlock();
        return Ok(Some(Holder::Replays));
    }
    let mut who = String::new();
    let _ = file.read_to_string(&mut who);
    let who = who.trim();
    Ok(Some(Holder::Recording(if who.is_empty() {
        "unknown".into()
    } else {
        who.into()
    })))
}

fn lock_path(home: &Path, run_id: &str) -> Result<PathBuf> {
    if run_id.is_empty() || run_id.contains(['/', '\0']) || run_id.starts_with('.') {
        return Err(Error::invalid(
            "run id",
            format!("{run_id:?} cannot name a lock file"),
        ));
    }
    Ok(home.join(LOCKS_DIR).join(format!("{run_id}.lock")))
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

    #[test]
    fn replays_share_a_run_that_a_recording_holds_alone_and_the_holder_is_told_apart() {
        let home = tempfile::tempdir().unwrap();
        let h = home.path();
        assert_eq!(holder(h, "r1").unwrap(), None, "never held");
        let a = RunLease::share(h, "r1").unwrap().unwrap();
        let b = RunLease::share(h, "r1").unwrap().unwrap();
        assert_eq!(holder(h, "r1").unwrap(), Some(Holder::Replays));
        // A resume of a run under replay is refused; the replays go on.
        assert!(RunLease::hold(h, "r1").is_err());
        drop((a, b));
        assert_eq!(holder(h, "r1").unwrap(), None, "asking holds nothing");
        let rec = RunLease::hold(h, "r1").unwrap();
        match holder(h, "r1").unwrap() {
            Some(Holder::Recording(who)) => {
                assert!(
                    who.contains(&format!("pid {}", std::process::id())),
                    "{who}"
                )
            }
            other => panic!("{other:?}"),
        }
        // A replay of a run being recorded goes on without a hold.
        assert!(RunLease::share(h, "r1").unwrap().is_none());
        drop(rec);
        assert_eq!(holder(h, "r1").unwrap(), None);
    }
}
