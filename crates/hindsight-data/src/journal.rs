//! The dispatcher's journal: an append-only, checksummed, fsync'd log of
//! opaque records on local disk. A dispatcher killed at any instant, in the
//! middle of a record included, restarts from it.
//!
//! # Format
//!
//! `journal.hsj` is the 8-byte magic `b"HSDJRNL1"` (version 1), then records:
//!
//! ```text
//! u32 LE payload length | u64 LE xxh3_64(length bytes ++ payload) | payload
//! ```
//!
//! The checksum covers the length too, so a damaged length is caught rather
//! than sending the reader to a wrong record boundary. A payload is at most
//! [`MAX_RECORD`] bytes: a larger length can only be damage.
//!
//! # Durability
//!
//! - [`Journal::append`] writes all its framed records with ONE write, then
//!   fdatasync. After `Ok` all of them are durable; after a crash a prefix of
//!   them is, and the rest of that write is a torn tail.
//! - [`Journal::compact`] writes `journal.hsj.tmp`, fsyncs it, renames it over
//!   the journal and fsyncs the directory: a crash leaves the old or the new
//!   journal, never a mix. A leftover temp file is removed at open.
//!
//! # Recovery rules ([`Journal::open`])
//!
//! 1. Header. Fewer than 8 bytes that are a prefix of the magic (an empty file
//!    included), or a file of zero bytes only, is a creation that crashed
//!    before its header was durable. No record can be in it (appends start
//!    after the header is synced, and zeros never form a valid record), so the
//!    header is rewritten. Any other header is [`JournalError::NotAJournal`],
//!    and the file is left untouched.
//! 2. Records are read in order. At the first position that does not hold a
//!    complete valid record (header or payload cut by end of file, length
//!    above [`MAX_RECORD`], checksum mismatch) recovery decides between a
//!    torn tail and corruption:
//!    - zero bytes only up to end of file: torn (a filesystem extended the
//!      file before the data landed);
//!    - a complete valid record starts at ANY later offset: the bytes after
//!      the bad record were written and are intact, so this is not a torn
//!      write but damage: [`JournalError::Corrupt`] at the bad record, file
//!      untouched. Every offset is tried, not only where the bad length
//!      points, because the length itself may be the damaged bytes;
//!    - otherwise (garbage or a partial record up to end of file): torn. The
//!      file is truncated at the bad record and the truncation is fsynced.
//!
//! A torn tail only ever holds a write that never returned `Ok`, so
//! truncating it loses no completed record. Two consequences, both on the
//! safe side: damage inside the LAST record is indistinguishable from a torn
//! write and is truncated like one; and a torn append whose later pages
//! reached the disk but whose first did not is reported as corrupt, because
//! an intact record is never dropped silently.

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::hash::Hasher as _;
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use twox_hash::XxHash3_64;

/// File header: identifies a dispatcher journal and its format version.
pub const MAGIC: &[u8; 8] = b"HSDJRNL1";

/// Largest payload of one record (16 MiB): bounds what a damaged length can
/// make the reader allocate or skip.
pub const MAX_RECORD: usize = 16 * 1024 * 1024;

/// Name of the journal file inside its directory.
pub const FILE_NAME: &str = "journal.hsj";

/// Name of the file `compact` writes before renaming it over the journal.
const TMP_NAME: &str = "journal.hsj.tmp";
const LOCK_NAME: &str = "journal.lock";

/// Bytes before each payload: u32 length + u64 checksum.
const FRAME_HEADER: usize = 12;

/// An open journal, positioned for appends at its end.
#[derive(Debug)]
pub struct Journal {
    /// Opened with O_APPEND: every write lands at the current end of file.
    file: File,
    dir: PathBuf,
    path: PathBuf,
    /// Length of the durable, valid content: where a failed append rolls back to.
    len: u64,
    /// The file may not end at `len` (a failed append could not be rolled
    /// back) or `file` may no longer be the journal (a compaction failed after
    /// its rename). Appends are refused until a compaction succeeds, so none
    /// lands after a half record.
    broken: bool,
    /// Held (flock) for the journal's lifetime: one dispatcher per journal.
    _lock: File,
}

/// What [`Journal::open`] found: the dispatcher logs it at startup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovery {
    /// Complete records read.
    pub records: usize,
    /// Bytes of a torn tail cut off after the header (a torn header is
    /// rewritten, not counted: it holds no record).
    pub truncated_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JournalError {
    #[error("journal {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Damage before the tail: refusing to start beats silently dropping the
    /// intact records after it.
    #[error("journal {path} is corrupt at byte {offset}: {reason} (records after it are intact, so this is not a torn write; restore the journal or start a new one with a new --journal directory)")]
    Corrupt {
        path: PathBuf,
        offset: u64,
        reason: String,
    },
    /// Another dispatcher holds this journal.
    #[error("journal {path} is in use by another dispatcher (it holds the lock); stop it or give this one another --journal directory")]
    Locked { path: PathBuf },
    #[error("journal {path}: not a hindsight dispatcher journal ({reason})")]
    NotAJournal { path: PathBuf, reason: String },
    #[error("journal {path}: record of {len} bytes exceeds the {max}-byte limit")]
    TooLarge {
        path: PathBuf,
        len: usize,
        max: usize,
    },
}

/// Take the directory's lock file exclusively, without waiting.
fn lock_dir(dir: &Path, journal: &Path) -> Result<File, JournalError> {
    let path = dir.join(LOCK_NAME);
    let f = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .map_err(io_at(&path))?;
    match f.try_lock() {
        Ok(()) => Ok(f),
        Err(std::fs::TryLockError::WouldBlock) => Err(JournalError::Locked {
            path: journal.to_path_buf(),
        }),
        Err(std::fs::TryLockError::Error(e)) => Err(io_at(&path)(e)),
    }
}

/// Maps an I/O error to [`JournalError::Io`] naming the file involved.
fn io_at(path: &Path) -> impl FnOnce(io::Error) -> JournalError + '_ {
    move |source| JournalError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Makes a created, renamed or removed directory entry durable.
fn sync_dir(dir: &Path) -> Result<(), JournalError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_at(dir))
}

impl Journal {
    /// Opens (creating the dir and file if missing) `dir/journal.hsj`, reads
    /// every record, truncates a torn tail (and fsyncs the truncation).
    /// Follows the recovery rules of the module doc.
    pub fn open(dir: &Path) -> Result<(Journal, Vec<Vec<u8>>, Recovery), JournalError> {
        fs::create_dir_all(dir).map_err(io_at(dir))?;
        let path = dir.join(FILE_NAME);
        let lock = lock_dir(dir, &path)?;

        // A crash during compact leaves the temp file; the journal itself is
        // complete (old or new) because the rename is atomic.
        let tmp = dir.join(TMP_NAME);
        match fs::remove_file(&tmp) {
            Ok(()) => sync_dir(dir)?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_at(&tmp)(e)),
        }

        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(&path)
            .map_err(io_at(&path))?;
        let mut buf = Vec::new();
        file.read_to_end(&mut buf).map_err(io_at(&path))?;
        let file_len = buf.len() as u64;
        let header_len = MAGIC.len() as u64;

        let torn_creation =
            (buf.len() < MAGIC.len() && MAGIC.starts_with(&buf)) || buf.iter().all(|&b| b == 0);
        if torn_creation {
            file.set_len(0)
                .and_then(|()| file.write_all(MAGIC))
                .and_then(|()| file.sync_all())
                .map_err(io_at(&path))?;
            // The file may be new: make its directory entry durable too.
            sync_dir(dir)?;
            let recovery = Recovery {
                records: 0,
                truncated_bytes: file_len.saturating_sub(header_len),
            };
            let journal = Journal {
                file,
                dir: dir.to_path_buf(),
                path,
                len: header_len,
                broken: false,
                _lock: lock,
            };
            return Ok((journal, Vec::new(), recovery));
        }
        let head = &buf[..buf.len().min(MAGIC.len())];
        if head != MAGIC {
            return Err(JournalError::NotAJournal {
                reason: format!(
                    "it starts with \"{}\", not \"{}\"",
                    head.escape_ascii(),
                    MAGIC.escape_ascii()
                ),
                path,
            });
        }

        let (records, tail) = scan(&buf);
        let kept = match tail {
            Tail::Clean => file_len,
            Tail::Torn(at) => {
                let at = at as u64;
                file.set_len(at)
                    .and_then(|()| file.sync_all())
                    .map_err(io_at(&path))?;
                at
            }
            Tail::Corrupt { at, reason } => {
                return Err(JournalError::Corrupt {
                    path,
                    offset: at as u64,
                    reason,
                })
            }
        };
        let recovery = Recovery {
            records: records.len(),
            truncated_bytes: file_len - kept,
        };
        let journal = Journal {
            file,
            dir: dir.to_path_buf(),
            path,
            len: kept,
            broken: false,
            _lock: lock,
        };
        Ok((journal, records, recovery))
    }

    /// Appends records in ONE write, then fdatasync. Either all are durable
    /// after `Ok`, or on crash a prefix of them is recoverable (a torn tail).
    /// On error nothing was appended: the file is cut back to its previous
    /// length so that a later append does not land after a half record.
    pub fn append(&mut self, records: &[&[u8]]) -> Result<(), JournalError> {
        if self.broken {
            return Err(self.broken_error());
        }
        let frames = encode(&self.path, records)?;
        if frames.is_empty() {
            return Ok(());
        }
        let written = self
            .file
            .write_all(&frames)
            .and_then(|()| self.file.sync_data());
        if let Err(e) = written {
            // Also after a failed fdatasync: the caller is told "not
            // appended", so the disk must not show the records later.
            let rolled_back = self
                .file
                .set_len(self.len)
                .and_then(|()| self.file.sync_all());
            self.broken = rolled_back.is_err();
            return Err(io_at(&self.path)(e));
        }
        self.len += frames.len() as u64;
        Ok(())
    }

    /// Replaces the whole journal by `records` atomically (write a temp file
    /// in the same dir, fsync, rename, fsync dir). Used to compact: a crash
    /// at any point leaves either the old or the new journal.
    pub fn compact(&mut self, records: &[&[u8]]) -> Result<(), JournalError> {
        let frames = encode(&self.path, records)?;
        let tmp = self.dir.join(TMP_NAME);
        if let Err(e) = write_synced(&tmp, &frames) {
            let _ = fs::remove_file(&tmp);
            return Err(io_at(&tmp)(e));
        }
        if let Err(e) = fs::rename(&tmp, &self.path) {
            // The old journal is still in place and `self.file` still is it.
            let _ = fs::remove_file(&tmp);
            return Err(io_at(&tmp)(e));
        }
        // From here `self.file` is the old, unlinked file until reopened.
        self.broken = true;
        self.file = OpenOptions::new()
            .read(true)
            .append(true)
            .open(&self.path)
            .map_err(io_at(&self.path))?;
        self.len = (MAGIC.len() + frames.len()) as u64;
        self.broken = false;
        sync_dir(&self.dir)
    }

    /// Path of the journal file, for messages.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Current length of the file (header included): decides when to compact.
    pub fn len_bytes(&self) -> u64 {
        self.len
    }

    fn broken_error(&self) -> JournalError {
        io_at(&self.path)(io::Error::other(
            "an earlier failed write could not be rolled back; reopen the journal to recover it",
        ))
    }
}

/// Writes a fresh journal (header + frames) to `path` and fsyncs it.
fn write_synced(path: &Path, frames: &[u8]) -> io::Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)?;
    f.write_all(MAGIC)?;
    f.write_all(frames)?;
    f.sync_all()
}

/// Frames `records` into one buffer, so an append is a single write.
fn encode(path: &Path, records: &[&[u8]]) -> Result<Vec<u8>, JournalError> {
    let mut total = 0;
    for r in records {
        if r.len() > MAX_RECORD {
            return Err(JournalError::TooLarge {
                path: path.to_path_buf(),
                len: r.len(),
                max: MAX_RECORD,
            });
        }
        total += FRAME_HEADER + r.len();
    }
    let mut out = Vec::with_capacity(total);
    for r in records {
        // Fits: checked against MAX_RECORD above.
        let len = (r.len() as u32).to_le_bytes();
        out.extend_from_slice(&len);
        out.extend_from_slice(&checksum(&len, r).to_le_bytes());
        out.extend_from_slice(r);
    }
    Ok(out)
}

/// xxh3_64 over (length bytes ++ payload), as the format specifies.
fn checksum(len: &[u8; 4], payload: &[u8]) -> u64 {
    let mut h = XxHash3_64::new();
    h.write(len);
    h.write(payload);
    h.finish()
}

/// Why the bytes at a position are not a complete valid record.
#[derive(Debug)]
enum Bad {
    HeaderCut,
    PayloadCut(u32),
    TooLong(u32),
    Checksum(u32),
}

impl fmt::Display for Bad {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Bad::HeaderCut => write!(f, "a record header runs past the end of the file"),
            Bad::PayloadCut(len) => {
                write!(f, "a {len}-byte record runs past the end of the file")
            }
            Bad::TooLong(len) => {
                write!(f, "record length {len} exceeds the {MAX_RECORD}-byte limit")
            }
            Bad::Checksum(len) => write!(f, "checksum mismatch in a {len}-byte record"),
        }
    }
}

/// The payload of the record at `pos`, if a complete valid one starts there.
/// Cheap checks (bounds, length limit) come before hashing, since the
/// corruption search calls this at every offset of a tail.
fn frame_at(buf: &[u8], pos: usize) -> Result<&[u8], Bad> {
    let rest = buf.get(pos..).unwrap_or_default();
    let Some((len_bytes, rest)) = rest.split_first_chunk::<4>() else {
        return Err(Bad::HeaderCut);
    };
    let Some((sum_bytes, rest)) = rest.split_first_chunk::<8>() else {
        return Err(Bad::HeaderCut);
    };
    let len = u32::from_le_bytes(*len_bytes);
    if len as usize > MAX_RECORD {
        return Err(Bad::TooLong(len));
    }
    let Some(payload) = rest.get(..len as usize) else {
        return Err(Bad::PayloadCut(len));
    };
    if checksum(len_bytes, payload) != u64::from_le_bytes(*sum_bytes) {
        return Err(Bad::Checksum(len));
    }
    Ok(payload)
}

/// How the record area of a journal ends.
#[derive(Debug, PartialEq, Eq)]
enum Tail {
    /// The last record ends exactly at end of file.
    Clean,
    /// A torn write starts at this offset: cut the file there.
    Torn(usize),
    /// Damage at this offset with intact records after it.
    Corrupt { at: usize, reason: String },
}

/// Reads the records after the magic (already checked) and classifies the
/// tail by the recovery rules of the module doc. Pure: never touches a file.
fn scan(buf: &[u8]) -> (Vec<Vec<u8>>, Tail) {
    let mut records = Vec::new();
    let mut pos = MAGIC.len();
    while pos < buf.len() {
        match frame_at(buf, pos) {
            Ok(payload) => {
                records.push(payload.to_vec());
                pos += FRAME_HEADER + payload.len();
            }
            Err(bad) => return (records, classify(buf, pos, &bad)),
        }
    }
    (records, Tail::Clean)
}

/// Torn tail or corruption, for a bad record at `pos` (see module doc).
fn classify(buf: &[u8], pos: usize, bad: &Bad) -> Tail {
    // Zeros never form a valid record: this only spares the search below.
    if buf[pos..].iter().all(|&b| b == 0) {
        return Tail::Torn(pos);
    }
    match (pos + 1..buf.len()).find(|&q| frame_at(buf, q).is_ok()) {
        Some(q) => Tail::Corrupt {
            at: pos,
            reason: format!("{bad}, yet an intact record starts at byte {q}"),
        },
        None => Tail::Torn(pos),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use xxhash_rust::xxh3::xxh3_64;

    /// Deterministic bytes without structure that could pass as a frame.
    fn pattern(len: usize, seed: u64) -> Vec<u8> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    fn refs(records: &[Vec<u8>]) -> Vec<&[u8]> {
        records.iter().map(Vec::as_slice).collect()
    }

    fn journal_file(dir: &Path) -> PathBuf {
        dir.join(FILE_NAME)
    }

    /// A journal holding `appends`, one `append` call each; returns its bytes.
    fn build(dir: &Path, appends: &[Vec<Vec<u8>>]) -> Vec<u8> {
        let (mut j, recs, _) = Journal::open(dir).unwrap();
        assert!(recs.is_empty());
        for a in appends {
            j.append(&refs(a)).unwrap();
        }
        let bytes = fs::read(j.path()).unwrap();
        assert_eq!(bytes.len() as u64, j.len_bytes());
        bytes
    }

    fn open_ok(dir: &Path) -> (Journal, Vec<Vec<u8>>, Recovery) {
        match Journal::open(dir) {
            Ok(v) => v,
            Err(e) => panic!("open failed: {e}"),
        }
    }

    #[test]
    fn a_second_dispatcher_on_the_same_journal_is_refused_until_the_first_closes() {
        let dir = tempfile::tempdir().unwrap();
        let (first, _, _) = Journal::open(dir.path()).unwrap();
        match Journal::open(dir.path()) {
            Err(JournalError::Locked { path }) => assert_eq!(path, dir.path().join(FILE_NAME)),
            other => panic!("expected Locked, got {:?}", other.map(|_| ())),
        }
        drop(first);
        assert!(Journal::open(dir.path()).is_ok());
    }

    #[test]
    fn format_is_pinned() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = build(dir.path(), &[vec![b"abc".to_vec()]]);
        let mut want = MAGIC.to_vec();
        want.extend_from_slice(&3u32.to_le_bytes());
        want.extend_from_slice(&xxh3_64(&[3, 0, 0, 0, b'a', b'b', b'c']).to_le_bytes());
        want.extend_from_slice(b"abc");
        assert_eq!(bytes, want);
    }

    #[test]
    fn round_trip_of_varied_sizes() {
        let dir = tempfile::tempdir().unwrap();
        let nested = dir.path().join("a/b");
        let mut all = vec![Vec::new(), vec![7], pattern(1 << 20, 1)];
        all.extend((0..200).map(|i| pattern(i * 37 % 5000, i as u64 + 2)));
        let appends: Vec<Vec<Vec<u8>>> = vec![
            all[..3].to_vec(),
            Vec::new(),
            all[3..50].to_vec(),
            all[50..51].to_vec(),
            all[51..].to_vec(),
        ];
        let bytes = build(&nested, &appends);
        let (j, recs, rec) = open_ok(&nested);
        assert_eq!(recs, all);
        assert_eq!(
            rec,
            Recovery {
                records: all.len(),
                truncated_bytes: 0
            }
        );
        assert_eq!(j.len_bytes(), bytes.len() as u64);
        assert_eq!(fs::read(journal_file(&nested)).unwrap(), bytes);
    }

    #[test]
    fn crash_mid_append_at_every_offset_of_the_last_record() {
        let src = tempfile::tempdir().unwrap();
        let prev = vec![b"one".to_vec(), Vec::new(), pattern(100, 3)];
        let last = pattern(300, 4);
        let prefix = build(src.path(), &[prev[..1].to_vec(), prev[1..].to_vec()]);
        let (mut j, _, _) = open_ok(src.path());
        j.append(&[&last]).unwrap();
        let full = fs::read(j.path()).unwrap();
        assert_eq!(full.len(), prefix.len() + FRAME_HEADER + last.len());
        assert_eq!(full[..prefix.len()], prefix[..]);

        let dir = tempfile::tempdir().unwrap();
        for cut in prefix.len()..full.len() {
            fs::write(journal_file(dir.path()), &full[..cut]).unwrap();
            let (mut j, recs, rec) = open_ok(dir.path());
            assert_eq!(recs, prev, "cut at {cut}");
            let torn = (cut - prefix.len()) as u64;
            assert_eq!(
                rec,
                Recovery {
                    records: 3,
                    truncated_bytes: torn
                }
            );
            assert_eq!(fs::read(j.path()).unwrap(), prefix, "cut at {cut}");
            j.append(&[b"new"]).unwrap();
            drop(j);
            let (_, recs, rec) = open_ok(dir.path());
            assert_eq!(recs[..3], prev[..]);
            assert_eq!(recs[3], b"new");
            assert_eq!(
                rec,
                Recovery {
                    records: 4,
                    truncated_bytes: 0
                }
            );
        }
    }

    #[test]
    fn crash_while_writing_the_header() {
        let dir = tempfile::tempdir().unwrap();
        for cut in 0..=MAGIC.len() {
            fs::write(journal_file(dir.path()), &MAGIC[..cut]).unwrap();
            let (mut j, recs, rec) = open_ok(dir.path());
            assert!(recs.is_empty());
            assert_eq!(
                rec,
                Recovery {
                    records: 0,
                    truncated_bytes: 0
                }
            );
            assert_eq!(fs::read(j.path()).unwrap(), MAGIC);
            j.append(&[b"x", b"yz"]).unwrap();
            drop(j);
            let (_, recs, _) = open_ok(dir.path());
            assert_eq!(recs, vec![b"x".to_vec(), b"yz".to_vec()]);
        }
        // Zeros where the header should be: the header's data never landed.
        fs::write(journal_file(dir.path()), [0u8; 30]).unwrap();
        let (_, recs, rec) = open_ok(dir.path());
        assert!(recs.is_empty());
        assert_eq!(
            rec,
            Recovery {
                records: 0,
                truncated_bytes: 22
            }
        );
        assert_eq!(fs::read(journal_file(dir.path())).unwrap(), MAGIC);
    }

    #[test]
    fn torn_tail_of_zeros_or_garbage_is_truncated() {
        let src = tempfile::tempdir().unwrap();
        let prev = vec![pattern(10, 5), pattern(2000, 6)];
        let good = build(src.path(), std::slice::from_ref(&prev));
        let dir = tempfile::tempdir().unwrap();
        for (i, n) in [1usize, 11, 12, 13, 100, 4096, 70_000]
            .into_iter()
            .enumerate()
        {
            for tail in [vec![0u8; n], pattern(n, 100 + i as u64)] {
                let mut bytes = good.clone();
                bytes.extend_from_slice(&tail);
                fs::write(journal_file(dir.path()), &bytes).unwrap();
                let (j, recs, rec) = open_ok(dir.path());
                assert_eq!(recs, prev);
                assert_eq!(
                    rec,
                    Recovery {
                        records: 2,
                        truncated_bytes: n as u64
                    }
                );
                assert_eq!(j.len_bytes(), good.len() as u64);
                assert_eq!(fs::read(j.path()).unwrap(), good);
            }
        }
    }

    #[test]
    fn damaged_byte_before_intact_records_is_corrupt() {
        let src = tempfile::tempdir().unwrap();
        let recs = [
            b"first".to_vec(),
            pattern(40, 7),
            b"third".to_vec(),
            pattern(1000, 8),
        ];
        let good = build(src.path(), &[recs[..2].to_vec(), recs[2..].to_vec()]);
        let start = MAGIC.len() + FRAME_HEADER + recs[0].len();
        let end = start + FRAME_HEADER + recs[1].len();
        let dir = tempfile::tempdir().unwrap();
        // Every byte of the second record: length, checksum and payload.
        for at in start..end {
            for mask in [0x01u8, 0x80, 0xFF] {
                let mut bytes = good.clone();
                bytes[at] ^= mask;
                fs::write(journal_file(dir.path()), &bytes).unwrap();
                match Journal::open(dir.path()) {
                    Err(JournalError::Corrupt { offset, .. }) => {
                        assert_eq!(offset, start as u64, "byte {at} ^ {mask:#x}")
                    }
                    Err(e) => panic!("byte {at} ^ {mask:#x}: wrong error {e}"),
                    Ok(_) => panic!("byte {at} ^ {mask:#x}: opened a corrupt journal"),
                }
                // The failed open must leave the evidence as it was.
                assert_eq!(fs::read(journal_file(dir.path())).unwrap(), bytes);
            }
        }
    }

    #[test]
    fn damaged_last_record_is_a_torn_tail() {
        // Indistinguishable from a torn write, so it is truncated (module doc).
        let src = tempfile::tempdir().unwrap();
        let recs = vec![b"first".to_vec(), pattern(40, 9)];
        let mut bytes = build(src.path(), std::slice::from_ref(&recs));
        let n = bytes.len();
        bytes[n - 5] ^= 0x10;
        let dir = tempfile::tempdir().unwrap();
        fs::write(journal_file(dir.path()), &bytes).unwrap();
        let (_, got, rec) = open_ok(dir.path());
        assert_eq!(got, recs[..1]);
        assert_eq!(
            rec,
            Recovery {
                records: 1,
                truncated_bytes: 52
            }
        );
    }

    #[test]
    fn wrong_magic_is_not_a_journal() {
        let dir = tempfile::tempdir().unwrap();
        let mut other = b"HSDJRNL2".to_vec();
        other.extend_from_slice(&pattern(50, 10));
        for bytes in [
            other,
            b"XY".to_vec(),
            b"HSDX".to_vec(),
            b"\0\0\0\0\0\0\0\0x".to_vec(),
        ] {
            fs::write(journal_file(dir.path()), &bytes).unwrap();
            match Journal::open(dir.path()) {
                Err(JournalError::NotAJournal { .. }) => {}
                Err(e) => panic!("{bytes:?}: wrong error {e}"),
                Ok(_) => panic!("{bytes:?}: opened"),
            }
            assert_eq!(fs::read(journal_file(dir.path())).unwrap(), bytes);
        }
    }

    #[test]
    fn too_large_record_is_refused_and_nothing_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _, _) = open_ok(dir.path());
        j.append(&[b"kept"]).unwrap();
        let before = j.len_bytes();
        let huge = vec![1u8; MAX_RECORD + 1];
        match j.append(&[b"small", &huge]) {
            Err(JournalError::TooLarge { len, max, .. }) => {
                assert_eq!((len, max), (MAX_RECORD + 1, MAX_RECORD))
            }
            other => panic!("expected TooLarge, got {other:?}"),
        }
        assert!(matches!(
            j.compact(&[&huge]),
            Err(JournalError::TooLarge { .. })
        ));
        assert_eq!(j.len_bytes(), before);
        // The limit itself is allowed.
        let max = vec![2u8; MAX_RECORD];
        j.append(&[&max]).unwrap();
        drop(j);
        let (_, recs, rec) = open_ok(dir.path());
        assert_eq!(recs, vec![b"kept".to_vec(), max.clone()]);
        assert_eq!(rec.truncated_bytes, 0);

        // On disk, a length over the limit is damage even with a matching
        // checksum; as the last record it is cut like a torn write.
        let mut frame = ((MAX_RECORD + 1) as u32).to_le_bytes().to_vec();
        let len = [frame[0], frame[1], frame[2], frame[3]];
        frame.extend_from_slice(&checksum(&len, &huge).to_le_bytes());
        frame.extend_from_slice(&huge);
        let mut file = OpenOptions::new()
            .append(true)
            .open(journal_file(dir.path()))
            .unwrap();
        file.write_all(&frame).unwrap();
        drop(file);
        let (_, recs, rec) = open_ok(dir.path());
        assert_eq!(recs, vec![b"kept".to_vec(), max]);
        assert_eq!(rec.truncated_bytes, frame.len() as u64);
    }

    #[test]
    fn compact_replaces_the_journal_and_appends_continue() {
        let dir = tempfile::tempdir().unwrap();
        let (mut j, _, _) = open_ok(dir.path());
        let many: Vec<Vec<u8>> = (0..50).map(|i| pattern(100 + i, i as u64)).collect();
        j.append(&refs(&many)).unwrap();
        let kept = vec![b"state".to_vec(), Vec::new(), pattern(500, 11)];
        j.compact(&refs(&kept)).unwrap();
        let want_len = (MAGIC.len() + 3 * FRAME_HEADER + 5 + 500) as u64;
        assert_eq!(j.len_bytes(), want_len);
        assert_eq!(fs::metadata(j.path()).unwrap().len(), want_len);
        assert!(!dir.path().join(TMP_NAME).exists());
        j.append(&[b"after", b"compact"]).unwrap();
        drop(j);
        let (mut j, recs, rec) = open_ok(dir.path());
        let mut want = kept.clone();
        want.extend([b"after".to_vec(), b"compact".to_vec()]);
        assert_eq!(recs, want);
        assert_eq!(
            rec,
            Recovery {
                records: 5,
                truncated_bytes: 0
            }
        );
        j.compact(&[]).unwrap();
        drop(j);
        assert_eq!(fs::read(journal_file(dir.path())).unwrap(), MAGIC);
    }

    #[test]
    fn leftover_compaction_temp_file_is_removed() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = build(dir.path(), &[vec![b"a".to_vec(), b"b".to_vec()]]);
        // A compaction that crashed before its rename.
        let mut half = MAGIC.to_vec();
        half.extend_from_slice(&pattern(33, 12));
        fs::write(dir.path().join(TMP_NAME), half).unwrap();
        let (_, recs, _) = open_ok(dir.path());
        assert_eq!(recs, vec![b"a".to_vec(), b"b".to_vec()]);
        assert!(!dir.path().join(TMP_NAME).exists());
        assert_eq!(fs::read(journal_file(dir.path())).unwrap(), bytes);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Any crash point: exactly the longest prefix of complete records
        /// comes back, and the journal takes appends again.
        #[test]
        fn truncation_recovers_the_longest_complete_prefix(
            appends in prop::collection::vec(
                prop::collection::vec(prop::collection::vec(any::<u8>(), 0..120), 0..4),
                0..6,
            ),
            cut in any::<prop::sample::Index>(),
        ) {
            let src = tempfile::tempdir().unwrap();
            let full = build(src.path(), &appends);
            let all: Vec<Vec<u8>> = appends.concat();
            let cut = cut.index(full.len() + 1);

            // Expected: records whose frame ends at or before the cut.
            let mut end = MAGIC.len();
            let mut complete = 0;
            for r in &all {
                if end + FRAME_HEADER + r.len() > cut {
                    break;
                }
                end += FRAME_HEADER + r.len();
                complete += 1;
            }
            let torn = cut.saturating_sub(end) as u64;

            let dir = tempfile::tempdir().unwrap();
            fs::write(journal_file(dir.path()), &full[..cut]).unwrap();
            let (mut j, recs, rec) = open_ok(dir.path());
            prop_assert_eq!(&recs[..], &all[..complete]);
            prop_assert_eq!(rec, Recovery { records: complete, truncated_bytes: torn });
            prop_assert_eq!(j.len_bytes(), end as u64);
            j.append(&[b"next"]).unwrap();
            drop(j);
            let (_, recs, _) = open_ok(dir.path());
            prop_assert_eq!(&recs[..complete], &all[..complete]);
            prop_assert_eq!(&recs[complete..], &[b"next".to_vec()][..]);
        }
    }
}
