//! Checkpoints saved by several ranks at once, as `torch.distributed`
//! jobs save them: each rank commits a *part* (its pieces of sharded
//! arrays, the replicated state it owns, its own per-rank state) under a
//! hidden name; one process then merges the parts into the checkpoint's
//! single manifest, committed last. Until that commit nothing is listed, so
//! a rank that dies mid-save leaves no partial checkpoint behind.
//!
//! Reading is by region: a rank of another layout asks for the box of the
//! whole array it holds, and only the chunks of the pieces that overlap the
//! box are read (and verified). A region some piece does not cover is an
//! error, never zeros.

use std::collections::BTreeMap;

use crate::checkpoint::format::{itemsize, Array, Blob, ChunkId, Manifest, Node, Shard, Sharded};
use crate::error::{Error, Result};

/// What a part's name adds to its checkpoint's name. Such names are hidden
/// from listings and refused for ordinary saves.
const PART_MARK: &str = "@hs-part-";
/// Manifest metadata: how many ranks saved the checkpoint.
pub const META_WORLD: &str = "hs.world";
pub use crate::checkpoint::format::META_ATTEMPT;
/// Part metadata: the digest of the replicated keys this rank saw (every
/// rank must see the same ones, or ownership would leave some unsaved).
pub const META_REPLICATED: &str = "hs.replicated";

/// Between a part's rank and world and its save attempt.
const ATTEMPT_MARK: &str = "-a";

/// The hidden name of rank `rank`'s part of checkpoint `name`, saved in
/// save attempt `attempt` (an id the ranks agreed on for this save: a
/// commit merges only the parts of its own attempt, never a rank's part
/// left by an earlier or another job's save of the same name).
pub fn part_name(name: &str, rank: u64, world: u64, attempt: &str) -> Result<String> {
    if world == 0 || rank >= world {
        return Err(Error::invalid(
            "rank",
            format!("rank {rank} is not a rank of a world of {world}"),
        ));
    }
    if is_part(name) {
        return Err(reserved(name));
    }
    if attempt.is_empty()
        || attempt.len() > 32
        || !attempt.bytes().all(|c| c.is_ascii_alphanumeric())
    {
        return Err(Error::invalid(
            "save attempt",
            format!("{attempt:?}: give 1-32 letters and digits"),
        ));
    }
    let part = format!("{name}{PART_MARK}{rank:05}-of-{world:05}{ATTEMPT_MARK}{attempt}");
    crate::checkpoint::format::validate_name(&part)?;
    Ok(part)
}

/// Whether `name` is a part's (hidden, not a checkpoint).
pub fn is_part(name: &str) -> bool {
    name.contains(PART_MARK)
}

/// What a part's name says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PartName<'a> {
    /// The checkpoint it is a part of.
    pub base: &'a str,
    pub rank: u64,
    pub world: u64,
    /// Its save attempt; `None` for a part saved before attempts were named
    /// (never merged: its attempt cannot be told).
    pub attempt: Option<&'a str>,
}

/// A part's name, read.
pub fn parse_part(name: &str) -> Option<PartName<'_>> {
    let (base, rest) = name.split_once(PART_MARK)?;
    let (r, rest) = rest.split_once("-of-")?;
    let (w, attempt) = match rest.split_once(ATTEMPT_MARK) {
        Some((w, a)) => (w, Some(a)),
        None => (rest, None),
    };
    Some(PartName {
        base,
        rank: r.parse().ok()?,
        world: w.parse().ok()?,
        attempt,
    })
}

/// The error for a user's checkpoint name that looks like a part's.
pub fn reserved(name: &str) -> Error {
    Error::invalid(
        format!("checkpoint name {name:?}"),
        format!(
            "names containing {PART_MARK:?} are reserved for the parts of multi-rank checkpoints"
        ),
    )
}

/// Which rank writes each replicated item (of `sizes` bytes, in the same
/// order on every rank): the largest first, each to the least loaded rank,
/// so that every rank writes about the same number of bytes.
pub fn assign_owners(sizes: &[u64], world: u64) -> Vec<u64> {
    let world = world.max(1);
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by(|&a, &b| sizes[b].cmp(&sizes[a]).then(a.cmp(&b)));
    let mut load = vec![0u64; world as usize];
    let mut owner = vec![0u64; sizes.len()];
    for i in order {
        let r = (0..load.len()).min_by_key(|&r| (load[r], r)).unwrap_or(0);
        load[r] += sizes[i];
        owner[i] = r as u64;
    }
    owner
}

/// A digest of the replicated items a rank saw (key, dtype, shape...).
pub fn replicated_digest(items: &[String]) -> String {
    let mut h = blake3::Hasher::new();
    for i in items {
        h.update(&(i.len() as u64).to_le_bytes());
        h.update(i.as_bytes());
    }
    h.finalize().to_hex()[..32].to_string()
}

/// Merge the parts of checkpoint `name` saved by `world` ranks into its one
/// manifest. Every rank's part must be there; the ranks must agree on every
/// value they both hold; the pieces of every sharded array must tile it.
pub fn merge(name: &str, world: u64, mut parts: Vec<Manifest>) -> Result<Manifest> {
    let what = || format!("checkpoint '{name}'");
    parts.sort_by_key(|m| parse_part(&m.name).map(|p| p.rank));
    let Some(attempt) = parts
        .first()
        .and_then(|m| parse_part(&m.name))
        .and_then(|p| p.attempt)
        .map(str::to_string)
    else {
        return Err(Error::invalid(what(), "no parts of a named save attempt"));
    };
    let ranks: Vec<u64> = parts
        .iter()
        .filter_map(|m| {
            parse_part(&m.name)
                .filter(|p| {
                    p.base == name && p.world == world && p.attempt == Some(attempt.as_str())
                })
                .map(|p| p.rank)
        })
        .collect();
    if ranks != (0..world).collect::<Vec<_>>() {
        let missing: Vec<String> = (0..world)
            .filter(|r| !ranks.contains(r))
            .map(|r| r.to_string())
            .collect();
        return Err(Error::invalid(
            what(),
            format!(
                "the parts of {world} ranks are needed; rank(s) {} have none",
                missing.join(", ")
            ),
        ));
    }
    let digest = |m: &Manifest| m.meta.get(META_REPLICATED).cloned().unwrap_or_default();
    if let Some(m) = parts.iter().find(|m| digest(m) != digest(&parts[0])) {
        let r = parse_part(&m.name).map_or(0, |p| p.rank);
        return Err(Error::invalid(
            what(),
            format!(
                "ranks 0 and {r} hold different replicated state (other keys, dtypes or shapes): \
                 each replicated value is written by one rank, so they must agree"
            ),
        ));
    }
    let mut it = parts.into_iter();
    let first = it
        .next()
        .ok_or_else(|| Error::invalid(what(), "no parts"))?;
    let mut root = first.root;
    for (r, part) in it.enumerate() {
        root = merge_node(root, part.root, &mut Vec::new(), r as u64 + 1)
            .map_err(|d| Error::invalid(what(), d))?;
    }
    check_tiling(&mut root, &mut Vec::new()).map_err(|d| Error::invalid(what(), d))?;
    let mut meta = first.meta;
    meta.remove(META_REPLICATED);
    meta.insert(META_WORLD.into(), world.to_string());
    meta.insert(META_ATTEMPT.into(), attempt);
    Ok(Manifest {
        format: first.format,
        name: name.to_string(),
        created_ms: first.created_ms,
        meta,
        root,
    })
}

/// The bytes of a blob, as the sequence of its chunks' content ids.
fn content(b: &Blob) -> Vec<(ChunkId, u64)> {
    b.chunks.iter().map(|c| (c.content_id(), c.len)).collect()
}

fn same_array(a: &Array, b: &Array) -> bool {
    a.lib == b.lib
        && a.dtype == b.dtype
        && a.shape == b.shape
        && content(&a.data) == content(&b.data)
}

/// Whether two ranks' values are the same (an array's device may differ).
fn same(a: &Node, b: &Node) -> bool {
    match (a, b) {
        (Node::Array(x), Node::Array(y)) => same_array(x, y),
        (Node::Bytes(x), Node::Bytes(y)) | (Node::Pickle(x), Node::Pickle(y)) => {
            content(x) == content(y)
        }
        _ => a == b,
    }
}

/// Rank `rank`'s tree merged into the tree of the ranks before it.
fn merge_node(
    a: Node,
    b: Node,
    path: &mut Vec<String>,
    rank: u64,
) -> std::result::Result<Node, String> {
    Ok(match (a, b) {
        (Node::Dict(mut x), Node::Dict(y)) => {
            for (k, v) in y {
                match x.iter().position(|(kx, _)| *kx == k) {
                    Some(i) => {
                        path.push(k.key_label());
                        let old = std::mem::replace(&mut x[i].1, Node::None);
                        x[i].1 = merge_node(old, v, path, rank)?;
                        path.pop();
                    }
                    None => x.push((k, v)),
                }
            }
            Node::Dict(x)
        }
        (Node::List(x), Node::List(y)) if x.len() == y.len() => {
            Node::List(merge_items(x, y, path, rank)?)
        }
        (Node::Tuple(x), Node::Tuple(y)) if x.len() == y.len() => {
            Node::Tuple(merge_items(x, y, path, rank)?)
        }
        (Node::Sharded(mut x), Node::Sharded(y)) => {
            if x.shape != y.shape {
                return Err(format!(
                    "rank {rank} saves the sharded array '{}' with shape {:?}, the ranks before it with {:?}",
                    path.join("/"),
                    y.shape,
                    x.shape
                ));
            }
            x.shards.extend(y.shards);
            Node::Sharded(x)
        }
        (x, y) if same(&x, &y) => x,
        (x, y) => {
            return Err(format!(
                "rank {rank} saves another value at '{}' ({}) than the ranks before it ({}): \
                 a value all ranks save must be the same on each",
                path.join("/"),
                y.kind(),
                x.kind()
            ))
        }
    })
}

fn merge_items(
    x: Vec<Node>,
    y: Vec<Node>,
    path: &mut Vec<String>,
    rank: u64,
) -> std::result::Result<Vec<Node>, String> {
    x.into_iter()
        .zip(y)
        .enumerate()
        .map(|(i, (a, b))| {
            path.push(i.to_string());
            let r = merge_node(a, b, path, rank);
            path.pop();
            r
        })
        .collect()
}

/// Whether every sharded array of a committed tree is covered by its
/// pieces exactly once: what a load of the whole array requires (`plan`),
/// so that `verify` refuses what a load would (pieces that overlap, leave a
/// hole, repeat, or are missing). The first failure, at its key path.
pub fn check_covered(node: &Node) -> std::result::Result<(), String> {
    fn walk(node: &Node, path: &mut Vec<String>) -> std::result::Result<(), String> {
        match node {
            Node::Sharded(sh) => {
                let zeros = vec![0; sh.shape.len()];
                plan(sh, &zeros, &sh.shape)
                    .map(|_| ())
                    .map_err(|d| format!("at '{}': {d}", path.join("/")))
            }
            Node::Dict(items) => items.iter().try_for_each(|(k, v)| {
                path.push(k.key_label());
                let r = walk(v, path);
                path.pop();
                r
            }),
            Node::List(items) | Node::Tuple(items) => {
                items.iter().enumerate().try_for_each(|(i, v)| {
                    path.push(i.to_string());
                    let r = walk(v, path);
                    path.pop();
                    r
                })
            }
            _ => Ok(()),
        }
    }
    walk(node, &mut Vec::new())
}

/// Every sharded array of a merged tree: pieces two ranks both saved (a
/// replicated placement) are kept once if their bytes agree; then the
/// pieces must cover the whole array exactly once.
fn check_tiling(node: &mut Node, path: &mut Vec<String>) -> std::result::Result<(), String> {
    match node {
        Node::Sharded(sh) => {
            let mut kept: Vec<Shard> = Vec::with_capacity(sh.shards.len());
            for p in std::mem::take(&mut sh.shards) {
                match kept
                    .iter()
                    .find(|k| k.offset == p.offset && k.array.shape == p.array.shape)
                {
                    Some(k) if same_array(&k.array, &p.array) => {}
                    Some(_) => {
                        return Err(format!(
                            "two ranks save different bytes for the piece at {:?} of '{}'",
                            p.offset,
                            path.join("/")
                        ))
                    }
                    None => kept.push(p),
                }
            }
            sh.shards = kept;
            let zeros = vec![0; sh.shape.len()];
            plan(sh, &zeros, &sh.shape.clone())
                .map(|_| ())
                .map_err(|d| format!("at '{}': {d}", path.join("/")))
        }
        Node::Dict(items) => items.iter_mut().try_for_each(|(k, v)| {
            path.push(k.key_label());
            let r = check_tiling(v, path);
            path.pop();
            r
        }),
        Node::List(items) | Node::Tuple(items) => {
            items.iter_mut().enumerate().try_for_each(|(i, v)| {
                path.push(i.to_string());
                let r = check_tiling(v, path);
                path.pop();
                r
            })
        }
        _ => Ok(()),
    }
}

/// A copy of `len` bytes from offset `src` of a piece to offset `dst` of
/// the region being read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

/// What to read of one piece for a region: its runs, in increasing order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PieceRead {
    pub shard: usize,
    pub runs: Vec<Run>,
}

fn volume(shape: &[u64]) -> u64 {
    shape.iter().product()
}

/// Plan the read of the box (`offset`, `shape`) of a sharded array: for each
/// piece that overlaps it, the byte runs to copy. The overlapping pieces
/// must cover the box exactly once.
pub fn plan(
    sh: &Sharded,
    offset: &[u64],
    shape: &[u64],
) -> std::result::Result<Vec<PieceRead>, String> {
    let d = sh.shape.len();
    let inside = offset.len() == d
        && shape.len() == d
        && offset
            .iter()
            .zip(shape)
            .zip(&sh.shape)
            .all(|((&o, &n), &w)| o.checked_add(n).is_some_and(|e| e <= w));
    if !inside {
        return Err(format!(
            "the region at {offset:?} of shape {shape:?} is not inside the array of shape {:?}",
            sh.shape
        ));
    }
    let Some(first) = sh.shards.first() else {
        return if volume(shape) == 0 {
            Ok(Vec::new())
        } else {
            Err("the array has no pieces (a rank's part is missing)".into())
        };
    };
    let item = itemsize(first.array.lib, &first.array.dtype)
        .ok_or_else(|| format!("unknown dtype {:?}", first.array.dtype))?;
    let mut out = Vec::new();
    let mut covered = 0u64;
    let mut boxes: Vec<(Vec<u64>, Vec<u64>)> = Vec::new();
    for (i, p) in sh.shards.iter().enumerate() {
        let lo: Vec<u64> = (0..d).map(|j| p.offset[j].max(offset[j])).collect();
        let hi: Vec<u64> = (0..d)
            .map(|j| (p.offset[j] + p.array.shape[j]).min(offset[j] + shape[j]))
            .collect();
        if (0..d).any(|j| hi[j] <= lo[j]) && d > 0 {
            continue;
        }
        if let Some((a, b)) = boxes
            .iter()
            .find(|(a, b)| (0..d).all(|j| a[j].max(lo[j]) < b[j].min(hi[j])))
        {
            return Err(format!(
                "pieces overlap in the box from {a:?} to {b:?} (the parts disagree on the layout)"
            ));
        }
        let ext: Vec<u64> = (0..d).map(|j| hi[j] - lo[j]).collect();
        covered += volume(&ext);
        out.push(PieceRead {
            shard: i,
            runs: runs(&p.offset, &p.array.shape, offset, shape, &lo, &ext, item),
        });
        boxes.push((lo, hi));
    }
    if covered != volume(shape) {
        return Err(format!(
            "the pieces cover {covered} of the {} elements of the region at {offset:?} of shape {shape:?} \
             (a rank's part is missing)",
            volume(shape)
        ));
    }
    Ok(out)
}

fn strides(shape: &[u64]) -> Vec<u64> {
    let mut s = vec![1u64; shape.len()];
    for j in (0..shape.len().saturating_sub(1)).rev() {
        s[j] = s[j + 1] * shape[j + 1];
    }
    s
}

/// The runs copying the box (`lo`, `ext`) from a piece (at `p_off`, of
/// `p_shape`) into a region (at `r_off`, of `r_shape`), row-major: the
/// trailing dimensions both hold whole become one run.
fn runs(
    p_off: &[u64],
    p_shape: &[u64],
    r_off: &[u64],
    r_shape: &[u64],
    lo: &[u64],
    ext: &[u64],
    item: u64,
) -> Vec<Run> {
    let d = ext.len();
    if d == 0 {
        return vec![Run {
            src: 0,
            dst: 0,
            len: item,
        }];
    }
    let mut k = d - 1;
    let mut elems = ext[k];
    while k > 0 && ext[k] == p_shape[k] && ext[k] == r_shape[k] {
        k -= 1;
        elems *= ext[k];
    }
    let (ps, rs) = (strides(p_shape), strides(r_shape));
    let mut out = Vec::with_capacity(volume(&ext[..k]) as usize);
    let mut idx = vec![0u64; k];
    loop {
        let mut src = 0;
        let mut dst = 0;
        for j in 0..d {
            let at = lo[j] + if j < k { idx[j] } else { 0 };
            src += (at - p_off[j]) * ps[j];
            dst += (at - r_off[j]) * rs[j];
        }
        out.push(Run {
            src: src * item,
            dst: dst * item,
            len: elems * item,
        });
        // The next index over the dimensions before k (odometer order).
        let mut j = k;
        loop {
            if j == 0 {
                return out;
            }
            j -= 1;
            idx[j] += 1;
            if idx[j] < ext[j] {
                break;
            }
            idx[j] = 0;
        }
    }
}

/// The chunks of a piece's blob a read needs (those its runs touch), as
/// contiguous segments: (the segment's first byte in the piece, its blob).
pub fn segments(blob: &Blob, runs: &[Run]) -> Vec<(u64, Blob)> {
    let mut out: Vec<(u64, Blob)> = Vec::new();
    let mut r = 0;
    let mut pos = 0u64;
    let mut prev_taken = false;
    for c in &blob.chunks {
        let (start, end) = (pos, pos + c.len);
        pos = end;
        while r < runs.len() && runs[r].src + runs[r].len <= start {
            r += 1;
        }
        let needed = r < runs.len() && runs[r].src < end;
        if needed {
            match out.last_mut() {
                Some((_, b)) if prev_taken => {
                    b.nbytes += c.len;
                    b.chunks.push(c.clone());
                }
                _ => out.push((
                    start,
                    Blob {
                        nbytes: c.len,
                        chunks: vec![c.clone()],
                        pending: None,
                    },
                )),
            }
        }
        prev_taken = needed;
    }
    out
}

/// Copy a piece's runs out of the segments read for it into `dest`.
pub fn copy_runs(
    runs: &[Run],
    segs: &[(u64, &[u8])],
    dest: &mut [u8],
) -> std::result::Result<(), String> {
    for run in runs {
        let i = segs.partition_point(|(start, _)| *start <= run.src);
        let (start, bytes) = i
            .checked_sub(1)
            .and_then(|i| segs.get(i))
            .ok_or("a run lies before every segment read")?;
        let from = (run.src - start) as usize;
        let (len, to) = (run.len as usize, run.dst as usize);
        let src = bytes
            .get(from..from + len)
            .ok_or("a run lies past the segment read for it")?;
        dest.get_mut(to..to + len)
            .ok_or("a run lies past the region")?
            .copy_from_slice(src);
    }
    Ok(())
}

/// A tree read whole, with each sharded array assembled into one array:
/// `buffers` are the blobs of `node` in tree order (each piece's whole
/// bytes); what comes back is the same with one buffer per assembled array.
pub fn consolidate(
    node: Node,
    buffers: Vec<Vec<u8>>,
) -> std::result::Result<(Node, Vec<Vec<u8>>), String> {
    let mut it = buffers.into_iter();
    let mut out = Vec::new();
    let node = consolidate_node(node, &mut it, &mut out, &mut Vec::new())?;
    Ok((node, out))
}

fn consolidate_node(
    node: Node,
    it: &mut std::vec::IntoIter<Vec<u8>>,
    out: &mut Vec<Vec<u8>>,
    path: &mut Vec<String>,
) -> std::result::Result<Node, String> {
    let mut next = || {
        it.next()
            .ok_or_else(|| "fewer buffers than blobs".to_string())
    };
    Ok(match node {
        Node::Bytes(_) | Node::Pickle(_) | Node::Array(_) => {
            out.push(next()?);
            node
        }
        Node::Sharded(sh) => {
            let bufs: Vec<Vec<u8>> = sh
                .shards
                .iter()
                .map(|_| next())
                .collect::<std::result::Result<_, _>>()?;
            let zeros = vec![0; sh.shape.len()];
            let reads = plan(&sh, &zeros, &sh.shape)
                .map_err(|d| format!("at '{}': {d}", path.join("/")))?;
            let first = &sh.shards[0].array;
            let item = itemsize(first.lib, &first.dtype).unwrap_or(1);
            let total =
                usize::try_from(volume(&sh.shape) * item).map_err(|_| "too large".to_string())?;
            let mut whole = crate::staging::try_zeroed(total).ok_or_else(|| {
                format!(
                    "'{}' needs {total} bytes, more than can be allocated here",
                    path.join("/")
                )
            })?;
            for r in reads {
                copy_runs(&r.runs, &[(0, &bufs[r.shard])], &mut whole)
                    .map_err(|d| format!("at '{}': {d}", path.join("/")))?;
            }
            out.push(whole);
            Node::Array(Box::new(Array {
                lib: first.lib,
                dtype: first.dtype.clone(),
                shape: sh.shape.clone(),
                byte_order: "little".into(),
                device: first.device.clone(),
                data: Blob {
                    nbytes: total as u64,
                    chunks: Vec::new(),
                    pending: None,
                },
            }))
        }
        Node::Dict(items) => {
            let mut v = Vec::with_capacity(items.len());
            for (k, n) in items {
                path.push(k.key_label());
                let n = consolidate_node(n, it, out, path)?;
                path.pop();
                v.push((k, n));
            }
            Node::Dict(v)
        }
        Node::List(items) => Node::List(consolidate_items(items, it, out, path)?),
        Node::Tuple(items) => Node::Tuple(consolidate_items(items, it, out, path)?),
        other => other,
    })
}

fn consolidate_items(
    items: Vec<Node>,
    it: &mut std::vec::IntoIter<Vec<u8>>,
    out: &mut Vec<Vec<u8>>,
    path: &mut Vec<String>,
) -> std::result::Result<Vec<Node>, String> {
    items
        .into_iter()
        .enumerate()
        .map(|(i, n)| {
            path.push(i.to_string());
            let r = consolidate_node(n, it, out, path);
            path.pop();
            r
        })
        .collect()
}

/// A whole array seen as a sharded one of a single piece (regions of any
/// array are read the same way).
pub fn as_sharded(node: &Node) -> Option<std::borrow::Cow<'_, Sharded>> {
    match node {
        Node::Sharded(s) => Some(std::borrow::Cow::Borrowed(s)),
        Node::Array(a) => Some(std::borrow::Cow::Owned(Sharded {
            shape: a.shape.clone(),
            shards: vec![Shard {
                offset: vec![0; a.shape.len()],
                array: (**a).clone(),
            }],
        })),
        _ => None,
    }
}

/// Metadata of a merged checkpoint: the world size that saved it.
pub fn saved_world(meta: &BTreeMap<String, String>) -> Option<u64> {
    meta.get(META_WORLD).and_then(|w| w.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::format::{ArrayLib, ChunkRef, FORMAT_VERSION};
    use proptest::prelude::*;

    /// Cut each dimension of `shape` at the given fractions: a grid of pieces.
    fn grid(shape: &[u64], cuts: &[Vec<u64>]) -> Vec<(Vec<u64>, Vec<u64>)> {
        let mut bounds: Vec<Vec<u64>> = Vec::new();
        for (j, &n) in shape.iter().enumerate() {
            let mut b: Vec<u64> = cuts[j].iter().map(|c| c % (n + 1)).collect();
            b.push(0);
            b.push(n);
            b.sort();
            b.dedup();
            bounds.push(b);
        }
        let mut out = vec![(Vec::new(), Vec::new())];
        for b in &bounds {
            let mut next = Vec::new();
            for (o, s) in &out {
                for w in b.windows(2) {
                    let (mut o2, mut s2) = (o.clone(), s.clone());
                    o2.push(w[0]);
                    s2.push(w[1] - w[0]);
                    next.push((o2, s2));
                }
            }
            out = next;
        }
        out
    }

    /// The row-major bytes of the box (`off`, `shape`) of a whole array whose
    /// element at flat index i is `f(i)` (4 bytes each).
    fn extract(whole: &[u64], off: &[u64], shape: &[u64]) -> Vec<u8> {
        let ws = strides(whole);
        let n = volume(shape);
        let ss = strides(shape);
        let mut out = Vec::with_capacity(n as usize * 4);
        for i in 0..n {
            let mut flat = 0;
            for j in 0..shape.len() {
                let idx = (i / ss[j]) % shape[j].max(1);
                flat += (off[j] + idx) * ws[j];
            }
            out.extend_from_slice(&(flat as u32 ^ 0x9e37_79b9).to_le_bytes());
        }
        out
    }

    fn blob(bytes: &[u8], chunk: usize) -> Blob {
        let chunks: Vec<ChunkRef> = bytes
            .chunks(chunk.max(1))
            .map(|c| ChunkRef::whole(ChunkId::of(c), c.len() as u64))
            .collect();
        Blob {
            nbytes: bytes.len() as u64,
            chunks,
            pending: None,
        }
    }

    fn sharded(
        whole: &[u64],
        pieces: &[(Vec<u64>, Vec<u64>)],
        chunk: usize,
    ) -> (Sharded, Vec<Vec<u8>>) {
        let mut shards = Vec::new();
        let mut data = Vec::new();
        for (o, s) in pieces {
            let bytes = extract(whole, o, s);
            shards.push(Shard {
                offset: o.clone(),
                array: Array {
                    lib: ArrayLib::Torch,
                    dtype: "float32".into(),
                    shape: s.clone(),
                    byte_order: "little".into(),
                    device: None,
                    data: blob(&bytes, chunk),
                },
            });
            data.push(bytes);
        }
        (
            Sharded {
                shape: whole.to_vec(),
                shards,
            },
            data,
        )
    }

    /// (whole shape, cuts per dimension, region offset and extent seeds, chunk size).
    type Case = (Vec<u64>, Vec<Vec<u64>>, Vec<u64>, Vec<u64>, usize);

    fn arb_case() -> impl Strategy<Value = Case> {
        (1usize..=3).prop_flat_map(|d| {
            (
                prop::collection::vec(1u64..9, d),
                prop::collection::vec(prop::collection::vec(0u64..10, 0..3), d),
                prop::collection::vec(0u64..9, d),
                prop::collection::vec(0u64..9, d),
                1usize..40,
            )
        })
    }

    proptest! {
        /// A region read from any grid sharding, through only the chunks
        /// `segments` selects, equals the same box of the whole array.
        #[test]
        fn every_byte_of_a_region_comes_from_the_right_piece((whole, cuts, a, b, chunk) in arb_case()) {
            let pieces = grid(&whole, &cuts);
            let (sh, data) = sharded(&whole, &pieces, chunk);
            let off: Vec<u64> = a.iter().zip(&whole).map(|(&x, &n)| x % n).collect();
            let shape: Vec<u64> = b.iter().zip(&whole).zip(&off).map(|((&y, &n), &o)| y % (n - o + 1)).collect();
            let reads = plan(&sh, &off, &shape).unwrap();
            let mut dest = vec![0u8; volume(&shape) as usize * 4];
            for r in &reads {
                let segs = segments(&sh.shards[r.shard].array.data, &r.runs);
                // Only chunks a run touches are read.
                for (start, b) in &segs {
                    let mut pos = *start;
                    for c in &b.chunks {
                        let (s, e) = (pos, pos + c.len);
                        prop_assert!(r.runs.iter().any(|run| run.src < e && s < run.src + run.len));
                        pos = e;
                    }
                }
                let bytes: Vec<(u64, Vec<u8>)> = segs
                    .iter()
                    .map(|(start, b)| (*start, data[r.shard][*start as usize..(*start + b.nbytes) as usize].to_vec()))
                    .collect();
                let view: Vec<(u64, &[u8])> = bytes.iter().map(|(s, v)| (*s, v.as_slice())).collect();
                copy_runs(&r.runs, &view, &mut dest).unwrap();
            }
            prop_assert_eq!(dest, extract(&whole, &off, &shape));
        }

        /// Parts saved on one grid merge and consolidate into the whole array;
        /// without one rank's part the merge is refused.
        #[test]
        fn parts_merge_into_the_whole_and_a_missing_part_is_refused((whole, cuts, _a, _b, chunk) in arb_case()) {
            let pieces = grid(&whole, &cuts);
            let world = pieces.len() as u64;
            let (sh, data) = sharded(&whole, &pieces, chunk);
            let parts: Vec<Manifest> = sh.shards.iter().enumerate().map(|(r, p)| Manifest {
                format: FORMAT_VERSION,
                name: part_name("ck", r as u64, world, "a1").unwrap(),
                created_ms: 0,
                meta: BTreeMap::new(),
                root: Node::Dict(vec![
                    (Node::Str("w".into()), Node::Sharded(Box::new(Sharded { shape: whole.clone(), shards: vec![p.clone()] }))),
                    (Node::Str("step".into()), Node::Int(7)),
                ]),
            }).collect();
            let m = merge("ck", world, parts.clone()).unwrap();
            prop_assert_eq!(m.meta.get(META_WORLD).cloned(), Some(world.to_string()));
            let Node::Dict(items) = &m.root else { panic!() };
            let w = items[0].1.clone();
            let (node, bufs) = consolidate(w, data.clone()).unwrap();
            prop_assert!(matches!(node, Node::Array(_)));
            prop_assert_eq!(&bufs[0], &extract(&whole, &vec![0; whole.len()], &whole));
            if world > 1 {
                let e = merge("ck", world, parts[1..].to_vec()).unwrap_err().to_string();
                prop_assert!(e.contains("rank(s) 0 have none"), "{}", e);
            }
        }
    }

    #[test]
    fn ranks_that_disagree_are_refused_naming_the_key() {
        let part = |r: u64, step: i64, piece: (Vec<u64>, Vec<u64>)| {
            let (sh, _) = sharded(&[4, 2], &[piece], 8);
            Manifest {
                format: FORMAT_VERSION,
                name: part_name("ck", r, 2, "a1").unwrap(),
                created_ms: 0,
                meta: BTreeMap::new(),
                root: Node::Dict(vec![
                    (Node::Str("w".into()), Node::Sharded(Box::new(sh))),
                    (Node::Str("step".into()), Node::Int(step)),
                ]),
            }
        };
        let top = (vec![0, 0], vec![2, 2]);
        let bottom = (vec![2, 0], vec![2, 2]);
        assert!(merge(
            "ck",
            2,
            vec![part(0, 3, top.clone()), part(1, 3, bottom.clone())]
        )
        .is_ok());
        let e = merge("ck", 2, vec![part(0, 3, top.clone()), part(1, 4, bottom)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 1 saves another value at 'step'"), "{e}");
        // Both ranks save the top half: the bottom is covered by nobody.
        let e = merge(
            "ck",
            2,
            vec![part(0, 3, top.clone()), part(1, 3, top.clone())],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("cover 4 of the 8 elements"), "{e}");
        // Overlapping pieces are refused.
        let e = merge(
            "ck",
            2,
            vec![part(0, 3, top), part(1, 3, (vec![1, 0], vec![3, 2]))],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("overlap"), "{e}");
        let mut a = part(0, 3, (vec![0, 0], vec![2, 2]));
        a.meta.insert(META_REPLICATED.into(), "x".into());
        let e = merge("ck", 2, vec![a, part(1, 3, (vec![2, 0], vec![2, 2]))])
            .unwrap_err()
            .to_string();
        assert!(e.contains("different replicated state"), "{e}");
    }

    #[test]
    fn part_names_are_hidden_and_owners_balance() {
        let p = part_name("run.epoch-000001", 3, 8, "9f2c").unwrap();
        assert!(is_part(&p));
        assert_eq!(
            parse_part(&p),
            Some(PartName {
                base: "run.epoch-000001",
                rank: 3,
                world: 8,
                attempt: Some("9f2c")
            })
        );
        // A part of before attempts were named is read, without one.
        let old = parse_part("ck@hs-part-00001-of-00002").unwrap();
        assert_eq!((old.rank, old.world, old.attempt), (1, 2, None));
        assert!(!is_part("run.epoch-000001"));
        assert!(part_name(&p, 0, 1, "a").is_err());
        assert!(part_name("x", 2, 2, "a").is_err());
        for bad in ["", "a-b", "a/b", &"a".repeat(33)] {
            assert!(part_name("x", 0, 2, bad).is_err(), "{bad:?}");
        }
        let owners = assign_owners(&[100, 1, 50, 50, 1], 2);
        let load = |r| {
            owners
                .iter()
                .zip([100, 1, 50, 50, 1])
                .filter(|(o, _)| **o == r)
                .map(|(_, s)| s)
                .sum::<u64>()
        };
        assert_eq!((load(0), load(1)), (101, 101));
        assert_eq!(assign_owners(&[5, 5, 5], 1), vec![0, 0, 0]);
    }
}
