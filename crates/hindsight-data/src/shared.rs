//! Same-host handoff of unit payloads through a shared-memory directory
//! (a `/dev/shm` directory that the local loader creates). A worker writes
//! the payload to a file there and sends only the file's name; the client
//! maps the file copy-on-write and unlinks it at once, so the pages go when
//! the last tensor viewing them does. Over TCP, the trainer copied every
//! batch three times (socket, frames, message) and faulted in fresh pages
//! for it; this is what kept `local:N` behind `DataLoader`'s shared memory.

use std::fs::OpenOptions;
use std::io::{self, Write};
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::{Bytes, BytesMut};
use memmap2::{MmapMut, MmapOptions};

/// Payloads smaller than this travel inline: a file costs more than the copy.
pub const MIN_SHARED: usize = 256 << 10;

/// A worker's side: writes payloads into the directory.
#[derive(Debug)]
pub struct SharedDir {
    dir: PathBuf,
    prefix: String,
    next: AtomicU64,
}

impl SharedDir {
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        // Unique per instance, not only per process: several workers in one
        // process (tests, embedders) must not race for the same names.
        static INSTANCES: AtomicU64 = AtomicU64::new(0);
        let instance = INSTANCES.fetch_add(1, Ordering::Relaxed);
        SharedDir {
            dir: dir.into(),
            prefix: format!("u{}-{instance}-", std::process::id()),
            next: AtomicU64::new(0),
        }
    }

    /// Writes `payload` to a new file and returns its name; None when the
    /// directory is full or unusable (the unit then travels inline).
    pub fn put(&self, payload: &[u8]) -> Option<String> {
        if payload.len() < MIN_SHARED {
            return None;
        }
        for _ in 0..4 {
            let name = format!(
                "{}{}",
                self.prefix,
                self.next.fetch_add(1, Ordering::Relaxed)
            );
            let path = self.dir.join(&name);
            let mut f = match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(f) => f,
                // A dead worker with this pid left one behind: another name.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(_) => return None,
            };
            if f.write_all(payload).is_ok() {
                return Some(name);
            }
            let _ = std::fs::remove_file(&path);
            return None;
        }
        None
    }

    /// Removes a file that was never handed over (its stream closed).
    pub fn remove(&self, name: &str) {
        if valid_name(name) {
            let _ = std::fs::remove_file(self.dir.join(name));
        }
    }
}

/// Only a plain file name is accepted from the wire: a worker can never
/// make the client open anything outside the directory it chose.
fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

/// The client's side: maps `name` from `dir` writable and unlinks it. A
/// shared mapping of the unlinked file, which nobody else holds: writes
/// through tensors built on it are the receiver's alone, and prefaulting
/// copies nothing (a private writable mapping would copy every page).
pub fn take(dir: &Path, name: &str) -> io::Result<MmapMut> {
    if !valid_name(name) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("not a shared-memory unit name: {name:?}"),
        ));
    }
    let path = dir.join(name);
    let file = OpenOptions::new().read(true).write(true).open(&path);
    let _ = std::fs::remove_file(&path);
    let file = file?;
    if file.metadata()?.len() == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "empty shared-memory unit",
        ));
    }
    // SAFETY: the file is unlinked and was completely written before its
    // name was sent; its writer never touches it again.
    unsafe { MmapOptions::new().populate().map_mut(&file) }
}

/// A delivered unit's bytes, owned by the receiver and writable, so tensors
/// can be views of them.
#[derive(Debug)]
pub enum Payload {
    Heap(BytesMut),
    Mapped(MmapMut),
}

impl Payload {
    /// Takes over a received buffer without copying when nothing else
    /// shares its allocation (the transport's buffer has moved on), and
    /// copies it otherwise.
    pub fn from_bytes(b: Bytes) -> Self {
        Payload::Heap(b.try_into_mut().unwrap_or_else(|b| BytesMut::from(&b[..])))
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        match self {
            Payload::Heap(b) => b.as_mut_ptr(),
            Payload::Mapped(m) => m.as_mut_ptr(),
        }
    }
}

impl From<Vec<u8>> for Payload {
    fn from(v: Vec<u8>) -> Self {
        Payload::from_bytes(Bytes::from(v))
    }
}

impl Deref for Payload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Payload::Heap(b) => b,
            Payload::Mapped(m) => m,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_goes_through_the_directory_and_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        let w = SharedDir::new(dir.path());
        let data: Vec<u8> = (0..MIN_SHARED + 7).map(|i| (i * 31) as u8).collect();
        let name = w.put(&data).expect("written");
        let mut got = Payload::Mapped(take(dir.path(), &name).unwrap());
        assert_eq!(&got[..], &data[..]);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        // Writable: tensors built on it may be modified in place.
        unsafe { *got.as_mut_ptr() ^= 0xff };
        assert_eq!(got[0], data[0] ^ 0xff);
        assert!(w.put(&data[..10]).is_none(), "small payloads travel inline");
    }

    #[test]
    fn two_workers_of_one_process_never_take_each_others_names() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (SharedDir::new(dir.path()), SharedDir::new(dir.path()));
        let data = vec![7u8; MIN_SHARED];
        // Files not yet taken by the client pile up under one worker's names...
        let pending: Vec<String> = (0..8).map(|_| a.put(&data).unwrap()).collect();
        // ...and the other worker still hands its units over, under its own.
        let other = b
            .put(&data)
            .expect("not pushed inline by the other worker's files");
        assert!(!pending.contains(&other));
    }

    #[test]
    fn names_from_the_wire_cannot_leave_the_directory() {
        let dir = tempfile::tempdir().unwrap();
        let outside = dir.path().join("secret");
        std::fs::write(&outside, b"x").unwrap();
        let inner = dir.path().join("d");
        std::fs::create_dir(&inner).unwrap();
        for name in ["../secret", "/etc/passwd", "", "a/b", ".."] {
            let e = take(&inner, name).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidData, "{name}");
        }
        assert!(outside.exists());
    }
}
