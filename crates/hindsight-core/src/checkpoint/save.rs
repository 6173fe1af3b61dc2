//! One save, from the front end's walk of the state to the commit: which
//! blob of the tree comes from where ([`Slot`]), the unchanged-tensor rule
//! (a tensor whose version counter says unchanged is reused only when its
//! whole content is proven equal), and the save session (begin, prove,
//! stage, lend, fill, commit: [`run`]). The binding walks Python objects
//! into slots and sources and calls [`run`] without the GIL; it decides
//! nothing about reuse.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::checkpoint::cancel::Cancel;
use crate::checkpoint::fingerprint::{fingerprint_many, Fingerprint};
use crate::checkpoint::format::{Blob, Node};
use crate::checkpoint::writer::{Lent, ReuseLock, SaveHandle, StagedBlob, Writer};
use crate::error::{Error, Result};

/// Below this size a tensor is always copied: cheaper than proving it unchanged.
pub const MIN_TRACKED_BYTES: usize = 64 << 10;

/// The version counter a tensor is tracked by between saves, if it is
/// tracked at all: only when unchanged tensors may be skipped, the tensor
/// has a counter (torch; not numpy) and is large enough to be worth a proof.
pub fn tracked_version(skip_unchanged: bool, nbytes: usize, version: Option<i64>) -> Option<i64> {
    version.filter(|_| skip_unchanged && nbytes >= MIN_TRACKED_BYTES)
}

/// Whether the blob a tensor was saved as last time is a candidate for this
/// save: same counter (the counter says "changed" for sure, never
/// "unchanged"), and its chunks still there and not from a failed save
/// (`reusable`, asked only when the counters agree: it may look at the
/// store). A candidate is still proven by its content before reuse.
pub fn candidate<E>(
    saved_version: i64,
    version: i64,
    reusable: impl FnOnce() -> std::result::Result<bool, E>,
) -> std::result::Result<bool, E> {
    Ok(saved_version == version && reusable()?)
}

/// Where one blob of the tree comes from, in walk order.
#[derive(Debug)]
pub enum Slot {
    /// Copy `sources[i]`.
    Stage(usize),
    /// The next lent buffer, written as it is (no copy).
    Lend,
    /// The previous save's blob, proven unchanged.
    Reuse(Blob),
    /// The version counter says unchanged: reuse `blob` if `sources[source]`
    /// still has `fingerprint`, else copy it.
    Verify {
        source: usize,
        blob: Blob,
        fingerprint: Fingerprint,
    },
}

/// The blob and (host) fingerprint of every slot once the save is staged.
#[derive(Debug)]
pub struct Filled {
    pub blobs: Vec<Blob>,
    pub fingerprints: Vec<Option<Fingerprint>>,
}

/// Decide every `Verify` slot: fingerprint the candidates (on `threads`
/// threads) and keep the previous blob only where the whole content
/// matches. Returns each slot's proven fingerprint where one was computed.
pub fn prove_unchanged(
    slots: &mut [Slot],
    sources: &[&[u8]],
    segment: usize,
    threads: usize,
) -> Vec<Option<Fingerprint>> {
    let candidates: Vec<(usize, usize)> = slots
        .iter()
        .enumerate()
        .filter_map(|(i, s)| match s {
            Slot::Verify { source, .. } => Some((i, *source)),
            _ => None,
        })
        .collect();
    let bufs: Vec<&[u8]> = candidates.iter().map(|&(_, src)| sources[src]).collect();
    let fps = fingerprint_many(&bufs, segment, threads);
    let mut proven = vec![None; slots.len()];
    for (&(i, src), fp) in candidates.iter().zip(fps) {
        let slot = std::mem::replace(&mut slots[i], Slot::Stage(src));
        if let Slot::Verify {
            blob, fingerprint, ..
        } = slot
        {
            if fingerprint == fp {
                slots[i] = Slot::Reuse(blob);
                proven[i] = Some(fp);
            }
        }
    }
    proven
}

/// Sources to copy, in slot order, once the `Verify` slots are decided.
pub fn stage_order(slots: &[Slot]) -> Vec<usize> {
    slots
        .iter()
        .filter_map(|s| match s {
            Slot::Stage(src) => Some(*src),
            _ => None,
        })
        .collect()
}

/// Put the staged, lent and reused blobs into the tree (walk order). A
/// count mismatch is a bug in the walk: an internal error, never an empty blob.
pub fn fill_blobs(
    root: &mut Node,
    slots: Vec<Slot>,
    staged: Vec<StagedBlob>,
    lent: Vec<Blob>,
    mut fingerprints: Vec<Option<Fingerprint>>,
) -> Result<Filled> {
    let n_slots = slots.len();
    let mut staged = staged.into_iter();
    let mut lent = lent.into_iter();
    let mut blobs = Vec::with_capacity(n_slots);
    for (i, slot) in slots.into_iter().enumerate() {
        match slot {
            Slot::Stage(_) => {
                let s = staged
                    .next()
                    .ok_or_else(|| internal("fewer staged blobs than slots"))?;
                fingerprints[i] = Some(s.fingerprint);
                blobs.push(s.blob);
            }
            Slot::Lend => blobs.push(
                lent.next()
                    .ok_or_else(|| internal("fewer lent blobs than slots"))?,
            ),
            Slot::Reuse(blob) => blobs.push(blob),
            Slot::Verify { .. } => return Err(internal("an unverified slot at fill time")),
        }
    }
    let mut it = blobs.iter();
    let mut count = 0;
    root.for_each_blob_mut(&mut |b| {
        count += 1;
        if let Some(blob) = it.next() {
            *b = blob.clone();
        }
    });
    if count != n_slots || staged.next().is_some() || lent.next().is_some() {
        return Err(internal(
            "the tree's blobs and the save's slots differ in number",
        ));
    }
    Ok(Filled {
        blobs,
        fingerprints,
    })
}

/// What a front end's walk of the state produced.
#[derive(Debug)]
pub struct Walked<'a> {
    pub root: Node,
    pub slots: Vec<Slot>,
    /// The bytes of every `Stage`/`Verify` source, alive until [`run`] returns.
    pub sources: Vec<&'a [u8]>,
    /// The buffers of the `Lend` slots, in order.
    pub lent: Vec<Arc<dyn Lent>>,
}

/// A committed (or committing) save.
#[derive(Debug)]
pub struct Saved {
    pub handle: SaveHandle,
    pub filled: Filled,
    /// One-time set-up of this save (fresh staging, pinned buffers).
    pub setup_seconds: f64,
}

/// The save session: begin (under `reuse`, the shared lock that keeps the
/// reused blobs' chunks), prove the unchanged candidates, stage the rest,
/// lend the device copies, count what was reused, fill the tree, commit.
/// Returns once every source byte is copied: the caller may then release
/// its buffers.
pub fn run(
    writer: &Writer,
    name: &str,
    reuse: Option<ReuseLock>,
    walked: Walked<'_>,
    meta: BTreeMap<String, String>,
    threads: usize,
    cancel: Cancel<'_>,
) -> Result<Saved> {
    let Walked {
        mut root,
        mut slots,
        sources,
        lent,
    } = walked;
    let mut b = writer.begin_with(name, reuse)?;
    let segment = b.fingerprint_segment();
    let proven = prove_unchanged(&mut slots, &sources, segment, threads);
    let order: Vec<&[u8]> = stage_order(&slots)
        .into_iter()
        .map(|i| sources[i])
        .collect();
    let staged = b.stage_many(&order, threads, cancel)?;
    let lent = b.lend(lent);
    let setup_seconds = b.setup_seconds();
    let reused: u64 = slots
        .iter()
        .map(|s| match s {
            Slot::Reuse(b) => b.nbytes,
            _ => 0,
        })
        .sum();
    b.note_reused(reused);
    let filled = fill_blobs(&mut root, slots, staged, lent, proven)?;
    Ok(Saved {
        handle: b.commit(root, meta),
        filled,
        setup_seconds,
    })
}

fn internal(what: &str) -> Error {
    Error::Internal {
        detail: format!("save: {what}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::fingerprint::fingerprint;

    #[test]
    fn a_candidate_is_reused_only_when_its_whole_content_is_equal() {
        let same = vec![7u8; 1 << 16];
        let mut changed = same.clone();
        changed[12_345] ^= 1; // one bit, where the counter said unchanged
        let fp = fingerprint(&same, 1 << 20, 1);
        let blob = Blob::default();
        let mut slots = vec![
            Slot::Verify {
                source: 0,
                blob: blob.clone(),
                fingerprint: fp,
            },
            Slot::Verify {
                source: 1,
                blob,
                fingerprint: fp,
            },
            Slot::Stage(2),
        ];
        let sources: Vec<&[u8]> = vec![&same, &changed, b"x"];
        let proven = prove_unchanged(&mut slots, &sources, 1 << 20, 2);
        assert!(matches!(slots[0], Slot::Reuse(_)));
        assert!(
            matches!(slots[1], Slot::Stage(1)),
            "a changed byte is copied again"
        );
        assert_eq!(proven[0], Some(fp));
        assert_eq!(proven[1], None);
        assert_eq!(stage_order(&slots), [1, 2]);
        assert_eq!(tracked_version(true, MIN_TRACKED_BYTES, Some(3)), Some(3));
        assert_eq!(tracked_version(true, MIN_TRACKED_BYTES - 1, Some(3)), None);
        assert_eq!(tracked_version(false, 1 << 30, Some(3)), None);
        let ok = |r: bool| move || Ok::<_, ()>(r);
        assert_eq!(candidate(3, 3, ok(true)), Ok(true));
        assert_eq!(candidate(3, 3, ok(false)), Ok(false));
        let never =
            || -> std::result::Result<bool, ()> { panic!("asked although the counters differ") };
        assert_eq!(candidate(3, 4, never), Ok(false));
    }
}
