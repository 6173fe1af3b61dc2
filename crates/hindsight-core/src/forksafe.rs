//! What a forked child must not keep: the store's file locks.
//!
//! A store lock is `flock(2)`, which belongs to the open file description,
//! and `fork` shares descriptions with the child. A DataLoader worker forked
//! while a save held the store's shared lock kept that lock for its whole
//! life: the trainer's own gc then waited for an exclusive lock forever (at
//! exit, while the loader's workers were still alive: a hang). So every held
//! lock's descriptor is registered here, and a `pthread_atfork` child
//! handler points each of them at `/dev/null` in the child: the child no
//! longer refers to the locked description (the parent's lock is untouched,
//! and the descriptor number stays valid for whatever closes it later).
//! The registry is a fixed array of atomics: the child handler may only do
//! async-signal-safe work.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::Once;

const SLOTS: usize = 256;
const FREE: i32 = -1;

static HELD: [AtomicI32; SLOTS] = [const { AtomicI32::new(FREE) }; SLOTS];
static HANDLER: Once = Once::new();

extern "C" fn in_child() {
    // SAFETY: open, dup2 and close are async-signal-safe; the path is a
    // static NUL-terminated string.
    unsafe {
        let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC);
        if null < 0 {
            return;
        }
        for slot in &HELD {
            let fd = slot.swap(FREE, Ordering::SeqCst);
            if fd >= 0 {
                libc::dup2(null, fd);
            }
        }
        libc::close(null);
    }
}

/// A lock is held through `fd`: a child forked from now on drops its
/// reference to it. Returns whether it was registered (all slots in use:
/// not, and the child keeps it, as before this module existed).
pub fn hold(fd: RawFd) -> bool {
    HANDLER.call_once(|| {
        // SAFETY: registers a plain extern "C" function once per process.
        unsafe {
            libc::pthread_atfork(None, None, Some(in_child));
        }
    });
    HELD.iter().any(|slot| {
        slot.compare_exchange(FREE, fd, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    })
}

/// The lock held through `fd` is released (before `fd` is closed).
pub fn release(fd: RawFd) {
    if let Some(slot) = HELD.iter().find(|s| s.load(Ordering::SeqCst) == fd) {
        let _ = slot.compare_exchange(fd, FREE, Ordering::SeqCst, Ordering::SeqCst);
    }
}

/// Open (creating it) the lock file at `path`, never through a link: the
/// file a store's gc or a run's lease takes `flock(2)` on.
pub fn open_lock_file(path: &std::path::Path) -> crate::error::Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| crate::error::Error::io(path, e))
}
