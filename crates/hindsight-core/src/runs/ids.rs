//! Run ids and source-snapshot content addresses.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::runs::dates;

static RUN_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A new run id `YYYYMMDD-HHMMSS-xxxxxx` for a run started at `started_ms`.
///
/// The 24-bit suffix is a bijective scramble of (a per-process offset derived
/// from the pid, the process's start time and a stack address) + a
/// process-wide counter: ids made by one process never repeat within a
/// second (2^24 of them), and two processes (forks included: the pid is part
/// of the offset) collide only by chance, which [`LogDb::create_run`]
/// catches on insert and retries with the next id.
pub fn new_run_id(started_ms: u64) -> String {
    static NONCE: OnceLock<[u8; 32]> = OnceLock::new();
    let nonce = NONCE.get_or_init(|| {
        let local = 0u8;
        let mut h = blake3::Hasher::new();
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        h.update(&nanos.to_le_bytes());
        h.update(&(std::ptr::addr_of!(local) as usize).to_le_bytes());
        *h.finalize().as_bytes()
    });
    let mut h = blake3::Hasher::new();
    h.update(nonce);
    h.update(&std::process::id().to_le_bytes());
    let b = h.finalize();
    let offset = u32::from_le_bytes([b.as_bytes()[0], b.as_bytes()[1], b.as_bytes()[2], 0]);
    let count = RUN_COUNTER.fetch_add(1, Ordering::Relaxed) as u32;
    const MASK: u32 = (1 << 24) - 1;
    // Bijections on 24 bits: odd multiplier, xor-shift.
    let mut x = offset.wrapping_add(count) & MASK;
    x = x.wrapping_mul(0x9E_3779) & MASK;
    x ^= x >> 12;
    x = x.wrapping_mul(0x85_EBCB) & MASK;
    x ^= x >> 11;
    format!("{}-{x:06x}", dates::compact_utc(started_ms))
}

/// Content address of a source snapshot (path -> file content): hex BLAKE3
/// of an unambiguous, length-prefixed encoding of the sorted entries.
pub fn source_hash(files: &BTreeMap<String, String>) -> String {
    let mut h = blake3::Hasher::new();
    h.update(b"hindsight-source-v1\0");
    h.update(&(files.len() as u64).to_le_bytes());
    for (path, content) in files {
        h.update(&(path.len() as u64).to_le_bytes());
        h.update(path.as_bytes());
        h.update(&(content.len() as u64).to_le_bytes());
        h.update(content.as_bytes());
    }
    h.finalize().to_hex().to_string()
}
