//! Is a live state the one a checkpoint holds? A replay worker that
//! executes an iteration the recording checkpointed compares what it holds
//! at that point with the checkpoint (issue "never silently wrong": a replay
//! proves itself or fails). The checkpoint's manifest is the recorded
//! fingerprint: its chunk ids are BLAKE3 hashes of the raw bytes, so the
//! live bytes are hashed along the recorded chunk boundaries and nothing is
//! read from storage.
//!
//! The rule, owned here:
//! - compared: the objects' state, the RNG states, the gradients, the loop
//!   position and the loop variables (the keys [`COMPARED`]); other keys of
//!   a checkpoint (when it was taken, files kept with it) are not state a
//!   replay computes;
//! - a key the live state has and the checkpoint does not is new code's
//!   (a variable a probe introduced): not compared; a key the checkpoint has
//!   and the live state lacks is a difference;
//! - a float among the loop variables that differs is a note, not a
//!   failure: wall-clock readings (`end = time.time()`, a meter of batch
//!   times) differ on every run, while a float a computation produced
//!   follows from the state compared strictly around it;
//! - an entry named [`ORIGIN`], at any depth, says how a live object was
//!   made, not what it computes (a DataLoader iterator's creation RNG
//!   states: a worker's own unseeded Python RNG differs from the
//!   recording's and draws nothing the iterator yields); it is not
//!   compared, the entries beside it (the iterator's position and its last
//!   draw) are;
//! - the loop variables as the iteration began ([`START_VARS`] under
//!   `vars`) are what a resume runs the code before the steps again from,
//!   not state the replay holds at this point (the state after them is
//!   compared), and a front end keeps them only where a checkpoint inside
//!   the iteration may need them: not compared, in either direction;
//! - everything else compares exactly: same kind, same value bits, same
//!   dtype, shape and bytes. An array the ranks saved in pieces (FSDP2) is
//!   compared piece by piece with the live whole array's regions.

use super::format::{itemsize, Array, ChunkId, Node, Sharded};

/// Top-level keys of a run's checkpoint that a replay must reproduce.
pub const COMPARED: [&str; 5] = ["objects", "rng", "grads", "loop", "vars"];
/// A dict entry that records how an object was made: kept, never compared.
pub const ORIGIN: &str = "__hindsight_origin__";
/// Under `vars`: the loop variables as the iteration began (a resume aid).
pub const START_VARS: &str = "iter";
/// The top-level key under which float differences are only notes.
const LENIENT: &str = "vars";

/// One difference between a checkpoint and a live state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Difference {
    /// Key path (`objects/model/fc.weight`).
    pub path: String,
    /// What differs, for a person.
    pub detail: String,
}

/// The outcome of [`check_state`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StateCheck {
    /// The first difference that makes the live state another one.
    pub first: Option<Difference>,
    /// Differences that do not (see the module docs), in walk order.
    pub notes: Vec<Difference>,
}

/// Compare `live` (a state tree whose blobs are not staged: the `n`-th blob
/// in [`Node::for_each_blob`] order holds `live_bytes[n]`) with `recorded`,
/// a checkpoint's root. Stops at the first difference.
pub fn check_state(recorded: &Node, live: &Node, live_bytes: &[&[u8]]) -> StateCheck {
    let mut walk = Walk {
        bytes: live_bytes,
        next: 0,
        out: StateCheck::default(),
        lenient: false,
    };
    let mut path = Vec::new();
    match (recorded, live) {
        (Node::Dict(rec), Node::Dict(items)) => {
            for (k, v) in items {
                let label = k.key_label();
                let found = rec.iter().find(|(rk, _)| rk == k);
                match found {
                    Some((_, r)) if COMPARED.contains(&label.as_str()) => {
                        walk.lenient = label == LENIENT;
                        path.push(label);
                        walk.node(r, v, &mut path);
                        path.pop();
                        if walk.out.first.is_some() {
                            break;
                        }
                    }
                    _ => walk.skip(v),
                }
            }
            if walk.out.first.is_none() {
                for (k, _) in rec {
                    let label = k.key_label();
                    if COMPARED.contains(&label.as_str()) && !items.iter().any(|(lk, _)| lk == k) {
                        walk.differ(&[label], "the checkpoint has it, the live state does not");
                        break;
                    }
                }
            }
        }
        _ => walk.node(recorded, live, &mut path),
    }
    walk.out
}

struct Walk<'a> {
    bytes: &'a [&'a [u8]],
    /// Index of the next live blob (walk order of the live tree).
    next: usize,
    out: StateCheck,
    lenient: bool,
}

impl Walk<'_> {
    fn differ(&mut self, path: &[String], detail: impl Into<String>) {
        self.out.first = Some(Difference {
            path: path.join("/"),
            detail: detail.into(),
        });
    }

    /// A live sub-tree that is not compared: its blobs still count.
    fn skip(&mut self, live: &Node) {
        live.for_each_blob(&mut Vec::new(), &mut |_, _| self.next += 1);
    }

    fn take_bytes(&mut self) -> &[u8] {
        let b = self.bytes.get(self.next).copied().unwrap_or(&[]);
        self.next += 1;
        b
    }

    /// Whether the next live blob holds what the recorded blob's chunks name.
    fn same_bytes(&mut self, recorded: &super::format::Blob) -> bool {
        let live = self.take_bytes();
        blob_holds(recorded, live)
    }

    /// A live whole array against the pieces the ranks saved of it: each
    /// piece's region of the live bytes must be that piece.
    fn same_pieces(&mut self, rec: &Sharded, live: &Array) -> Result<(), String> {
        let bytes = self.take_bytes();
        let Some(item) = itemsize(live.lib, &live.dtype) else {
            return Err(format!("dtype {} has no known size", live.dtype));
        };
        for piece in &rec.shards {
            let a = &piece.array;
            if a.lib != live.lib || a.dtype != live.dtype {
                return Err(format!(
                    "recorded pieces of {:?} {}, live a {:?} {} array",
                    a.lib, a.dtype, live.lib, live.dtype
                ));
            }
            let region =
                region(bytes, &rec.shape, &piece.offset, &a.shape, item).ok_or_else(|| {
                    format!("a piece at {:?} does not fit the live array", piece.offset)
                })?;
            if !blob_holds(&a.data, &region) {
                return Err(format!(
                    "the {} values of the piece at {:?} (shape {:?}) differ from the recorded ones",
                    a.dtype, piece.offset, a.shape
                ));
            }
        }
        Ok(())
    }
}

impl Walk<'_> {
    /// A rank's own live pieces (its FSDP2 shards, never gathered whole)
    /// against the pieces the ranks saved: each must be one of them, byte
    /// for byte. The same world size cuts the same pieces; another cut is
    /// named as such, not compared.
    fn same_own_pieces(&mut self, rec: &Sharded, live: &Sharded) -> Result<(), String> {
        let mut first = None;
        for piece in &live.shards {
            let bytes = self.take_bytes();
            if first.is_some() {
                continue; // the rest of the live blobs still count
            }
            let a = &piece.array;
            first = if rec.shape != live.shape {
                Some(format!(
                    "recorded an array of shape {:?} in pieces, live a piece of one of shape {:?}",
                    rec.shape, live.shape
                ))
            } else {
                match rec
                    .shards
                    .iter()
                    .find(|r| r.offset == piece.offset && r.array.shape == a.shape)
                {
                    None => Some(format!(
                        "the live piece at {:?} (shape {:?}) is not one the recording saved: another sharding",
                        piece.offset, a.shape
                    )),
                    Some(r) if r.array.lib != a.lib || r.array.dtype != a.dtype => Some(format!(
                        "recorded pieces of {:?} {}, live a {:?} {} piece",
                        r.array.lib, r.array.dtype, a.lib, a.dtype
                    )),
                    Some(r) if !blob_holds(&r.array.data, bytes) => Some(format!(
                        "the {} values of the piece at {:?} (shape {:?}) differ from the recorded ones",
                        a.dtype, piece.offset, a.shape
                    )),
                    Some(_) => None,
                }
            };
        }
        first.map_or(Ok(()), Err)
    }
}

/// The bytes of the region at `offset` of extent `extent` in a row-major
/// array of `shape` whose bytes are `whole` (`item` bytes per element);
/// None when the region does not fit.
fn region(
    whole: &[u8],
    shape: &[u64],
    offset: &[u64],
    extent: &[u64],
    item: u64,
) -> Option<Vec<u8>> {
    let n = shape.len();
    if offset.len() != n || extent.len() != n || (0..n).any(|d| offset[d] + extent[d] > shape[d]) {
        return None;
    }
    if whole.len() as u64 != shape.iter().product::<u64>() * item {
        return None;
    }
    let Some(last) = n.checked_sub(1) else {
        return Some(whole.to_vec()); // a 0-d array is its one element
    };
    let mut out = Vec::with_capacity((extent.iter().product::<u64>() * item) as usize);
    if extent.contains(&0) {
        return Some(out);
    }
    // Row-major strides in elements.
    let mut stride = vec![1u64; n];
    for d in (0..last).rev() {
        stride[d] = stride[d + 1] * shape[d + 1];
    }
    let run = (extent[last] * item) as usize;
    let mut idx = vec![0u64; last]; // position within the extent, all but the last dim
    loop {
        let start: u64 = (0..last)
            .map(|d| (offset[d] + idx[d]) * stride[d])
            .sum::<u64>()
            + offset[last];
        let at = (start * item) as usize;
        out.extend_from_slice(whole.get(at..at + run)?);
        // The next index, last dimension fastest.
        let mut d = last;
        loop {
            if d == 0 {
                return Some(out);
            }
            d -= 1;
            idx[d] += 1;
            if idx[d] < extent[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// Whether `live` holds what the recorded blob's chunks name.
fn blob_holds(recorded: &super::format::Blob, live: &[u8]) -> bool {
    if live.len() as u64 != recorded.nbytes {
        return false;
    }
    let mut off = 0usize;
    for c in &recorded.chunks {
        let Some(seg) = live.get(off..off + c.len as usize) else {
            return false;
        };
        if ChunkId::of(seg) != c.content_id() {
            return false;
        }
        off += c.len as usize;
    }
    off == live.len()
}

impl Walk<'_> {
    /// Compare one recorded node with the live one at `path`.
    fn node(&mut self, rec: &Node, live: &Node, path: &mut Vec<String>) {
        if self.out.first.is_some() {
            return;
        }
        match (rec, live) {
            (Node::Dict(r), Node::Dict(l)) => {
                let at_vars = path.len() == 1 && path[0] == LENIENT;
                let start_vars = |k: &Node| at_vars && k.key_label() == START_VARS;
                for (k, v) in l {
                    match r.iter().find(|(rk, _)| rk == k) {
                        Some(_) if k.key_label() == ORIGIN || start_vars(k) => self.skip(v),
                        Some((_, rv)) => {
                            path.push(k.key_label());
                            self.node(rv, v, path);
                            path.pop();
                        }
                        None => self.skip(v),
                    }
                    if self.out.first.is_some() {
                        return;
                    }
                }
                if let Some((k, _)) = r
                    .iter()
                    .find(|(rk, _)| !start_vars(rk) && !l.iter().any(|(lk, _)| lk == rk))
                {
                    path.push(k.key_label());
                    self.differ(path, "the checkpoint has it, the live state does not");
                    path.pop();
                }
            }
            (Node::List(r), Node::List(l)) | (Node::Tuple(r), Node::Tuple(l)) => {
                if r.len() != l.len() {
                    for v in l {
                        self.skip(v);
                    }
                    return self.differ(
                        path,
                        format!("{} items recorded, {} live", r.len(), l.len()),
                    );
                }
                for (i, (rv, lv)) in r.iter().zip(l).enumerate() {
                    path.push(i.to_string());
                    self.node(rv, lv, path);
                    path.pop();
                    if self.out.first.is_some() {
                        return;
                    }
                }
            }
            (Node::Array(r), Node::Array(l)) => {
                if r.lib != l.lib || r.dtype != l.dtype || r.shape != l.shape {
                    self.next += 1;
                    return self.differ(
                        path,
                        format!(
                            "recorded a {:?} {} array of shape {:?}, live a {:?} {} of shape {:?}",
                            r.lib, r.dtype, r.shape, l.lib, l.dtype, l.shape
                        ),
                    );
                }
                if !self.same_bytes(&r.data) {
                    self.differ(
                        path,
                        format!(
                            "the {} values of shape {:?} differ from the recorded ones",
                            r.dtype, r.shape
                        ),
                    );
                }
            }
            (Node::Sharded(r), Node::Array(l)) => {
                if r.shape != l.shape {
                    self.next += 1;
                    return self.differ(
                        path,
                        format!(
                            "recorded an array of shape {:?} in pieces, live one of shape {:?}",
                            r.shape, l.shape
                        ),
                    );
                }
                if let Err(detail) = self.same_pieces(r, l) {
                    self.differ(path, detail);
                }
            }
            (Node::Sharded(r), Node::Sharded(l)) => {
                if let Err(detail) = self.same_own_pieces(r, l) {
                    self.differ(path, detail);
                }
            }
            (Node::Bytes(r), Node::Bytes(_)) | (Node::Pickle(r), Node::Pickle(_)) => {
                if !self.same_bytes(r) {
                    self.differ(
                        path,
                        format!("the {} differ from the recorded ones", rec.kind()),
                    );
                }
            }
            (Node::Float(r), Node::Float(l)) if r != l => {
                let detail = format!(
                    "recorded {}, live {}",
                    f64::from_bits(*r),
                    f64::from_bits(*l)
                );
                if self.lenient {
                    self.out.notes.push(Difference {
                        path: path.join("/"),
                        detail,
                    });
                } else {
                    self.differ(path, detail);
                }
            }
            (Node::Float(_), Node::Float(_)) => {}
            (r, l) if r.kind() != l.kind() => {
                self.skip(l);
                self.differ(
                    path,
                    format!("recorded a {}, live a {}", r.kind(), l.kind()),
                );
            }
            (r, l) => {
                if r != l {
                    self.differ(path, format!("recorded {}, live {}", scalar(r), scalar(l)));
                }
            }
        }
    }
}

fn scalar(n: &Node) -> String {
    match n {
        Node::Str(s) => format!("{s:?}"),
        other => other.key_label(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::format::{Array, ArrayLib, Blob, ChunkRef};

    fn s(x: &str) -> Node {
        Node::Str(x.into())
    }

    /// A recorded array blob of `bytes`, cut into chunks of `chunk` bytes.
    fn recorded_array(bytes: &[u8], chunk: usize) -> Node {
        let chunks = bytes
            .chunks(chunk)
            .map(|c| ChunkRef::whole(ChunkId::of(c), c.len() as u64))
            .collect();
        array(Blob {
            nbytes: bytes.len() as u64,
            chunks,
            pending: None,
        })
    }

    fn array(data: Blob) -> Node {
        Node::Array(Box::new(Array {
            lib: ArrayLib::Torch,
            dtype: "float32".into(),
            shape: vec![2, 2],
            byte_order: "little".into(),
            device: None,
            data,
        }))
    }

    fn state(weight: Node, step: i64, clock: f64) -> Node {
        Node::Dict(vec![
            (s("at"), s("block")),
            (
                s("objects"),
                Node::Dict(vec![(
                    s("model"),
                    Node::Dict(vec![(s("fc.weight"), weight)]),
                )]),
            ),
            (s("loop"), Node::List(vec![Node::Int(step)])),
            (
                s("vars"),
                Node::Dict(vec![(s("end"), Node::Float(clock.to_bits()))]),
            ),
        ])
    }

    const W: [u8; 16] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16];

    #[test]
    fn the_same_state_passes_whatever_the_chunk_boundaries() {
        let rec = state(recorded_array(&W, 5), 3, 1.5);
        let live = state(array(Blob::default()), 3, 1.5);
        assert_eq!(check_state(&rec, &live, &[&W]), StateCheck::default());
    }

    /// A 3x4 float32 array (48 bytes) recorded in pieces at `cuts`: (offset, extent).
    fn recorded_pieces(whole: &[u8], cuts: &[([u64; 2], [u64; 2])]) -> Node {
        let shards = cuts
            .iter()
            .map(|(offset, extent)| {
                let bytes = region(whole, &[3, 4], offset, extent, 4).unwrap();
                let Node::Array(mut a) = recorded_array(&bytes, 7) else {
                    unreachable!()
                };
                a.shape = extent.to_vec();
                crate::checkpoint::format::Shard {
                    offset: offset.to_vec(),
                    array: *a,
                }
            })
            .collect();
        Node::Sharded(Box::new(Sharded {
            shape: vec![3, 4],
            shards,
        }))
    }

    #[test]
    fn an_array_saved_in_pieces_is_compared_piece_by_piece_with_the_live_whole() {
        let whole: Vec<u8> = (0..48u8).collect();
        let live = Node::Array(Box::new(Array {
            shape: vec![3, 4],
            ..match array(Blob::default()) {
                Node::Array(a) => *a,
                _ => unreachable!(),
            }
        }));
        // Rows (FSDP2's dim-0 shards, uneven) and blocks across both dimensions.
        for cuts in [
            vec![([0, 0], [2, 4]), ([2, 0], [1, 4])],
            vec![([0, 0], [3, 1]), ([0, 1], [3, 3])],
            vec![([0, 0], [2, 2]), ([0, 2], [2, 2]), ([2, 0], [1, 4])],
        ] {
            let rec = recorded_pieces(&whole, &cuts);
            assert_eq!(check_state(&rec, &live, &[&whole]).first, None, "{cuts:?}");
            // One byte changed in each piece in turn: named, with the piece.
            for (offset, _) in &cuts {
                let mut other = whole.clone();
                let at = ((offset[0] * 4 + offset[1]) * 4) as usize;
                other[at] ^= 1;
                let d = check_state(&rec, &live, &[&other]).first.unwrap();
                assert!(
                    d.detail.contains(&format!("piece at {offset:?}")),
                    "{cuts:?}: {}",
                    d.detail
                );
            }
        }
        // Another live shape, or a live buffer of the wrong size: a difference, not a panic.
        let rec = recorded_pieces(&whole, &[([0, 0], [3, 4])]);
        let d = check_state(&rec, &live, &[&whole[..40]]).first.unwrap();
        assert!(
            d.detail.contains("does not fit the live array"),
            "{}",
            d.detail
        );
        let wide = Node::Array(Box::new(Array {
            shape: vec![4, 3],
            ..match array(Blob::default()) {
                Node::Array(a) => *a,
                _ => unreachable!(),
            }
        }));
        let d = check_state(&rec, &wide, &[&whole]).first.unwrap();
        assert!(d.detail.contains("in pieces"), "{}", d.detail);
    }

    #[test]
    fn a_ranks_own_pieces_are_compared_with_the_recorded_ones_without_the_whole() {
        let whole: Vec<u8> = (0..48u8).collect();
        let cuts = [([0, 0], [2, 4]), ([2, 0], [1, 4])];
        let rec = recorded_pieces(&whole, &cuts);
        // Each rank's live piece: the same cut, with its own bytes only.
        let live_piece = |offset: [u64; 2], extent: [u64; 2]| {
            let Node::Array(mut a) = array(Blob::default()) else {
                unreachable!()
            };
            a.shape = extent.to_vec();
            Node::Sharded(Box::new(Sharded {
                shape: vec![3, 4],
                shards: vec![crate::checkpoint::format::Shard {
                    offset: offset.to_vec(),
                    array: *a,
                }],
            }))
        };
        for (offset, extent) in cuts {
            let mine = region(&whole, &[3, 4], &offset, &extent, 4).unwrap();
            let live = live_piece(offset, extent);
            assert_eq!(check_state(&rec, &live, &[&mine]).first, None, "{offset:?}");
            let mut other = mine.clone();
            other[3] ^= 1;
            let d = check_state(&rec, &live, &[&other]).first.unwrap();
            assert!(
                d.detail.contains(&format!("piece at {offset:?}")),
                "{}",
                d.detail
            );
        }
        // Another cut is named, not compared.
        let live = live_piece([1, 0], [2, 4]);
        let some = region(&whole, &[3, 4], &[1, 0], &[2, 4], 4).unwrap();
        let d = check_state(&rec, &live, &[&some]).first.unwrap();
        assert!(d.detail.contains("another sharding"), "{}", d.detail);
    }

    #[test]
    fn a_changed_tensor_is_named_by_its_key_path() {
        let rec = state(recorded_array(&W, 5), 3, 1.5);
        let live = state(array(Blob::default()), 3, 1.5);
        let mut other = W;
        other[15] ^= 1;
        let d = check_state(&rec, &live, &[&other]).first.unwrap();
        assert_eq!(d.path, "objects/model/fc.weight");
        assert!(d.detail.contains("float32"), "{}", d.detail);
        // A truncated buffer differs too (not a panic, not a pass).
        let d = check_state(&rec, &live, &[&W[..12]]).first.unwrap();
        assert_eq!(d.path, "objects/model/fc.weight");
    }

    #[test]
    fn scalars_and_missing_keys_differ_but_new_keys_and_clock_floats_do_not_fail() {
        let rec = state(recorded_array(&W, 16), 3, 1.5);
        let live = state(array(Blob::default()), 4, 1.5);
        let d = check_state(&rec, &live, &[&W]).first.unwrap();
        assert_eq!(
            (d.path.as_str(), d.detail.as_str()),
            ("loop/0", "recorded 3, live 4")
        );

        // A float among the loop variables: a note.
        let live = state(array(Blob::default()), 3, 2.5);
        let c = check_state(&rec, &live, &[&W]);
        assert_eq!(c.first, None);
        assert_eq!(c.notes.len(), 1);
        assert_eq!(c.notes[0].path, "vars/end");

        // A key only the live state has (a probe's variable; a top-level key
        // that is not state) is not compared, and its blobs are skipped in order.
        let Node::Dict(mut items) = state(array(Blob::default()), 3, 1.5) else {
            unreachable!()
        };
        items.insert(0, (s("files"), Node::Bytes(Blob::default())));
        let live = Node::Dict(items);
        assert_eq!(check_state(&rec, &live, &[b"xx", &W]).first, None);

        // A key the checkpoint has and the live state lacks is a difference.
        let live = Node::Dict(vec![(s("loop"), Node::List(vec![Node::Int(3)]))]);
        let d = check_state(&rec, &live, &[]).first.unwrap();
        assert_eq!(d.path, "objects");
    }

    #[test]
    fn the_iterations_start_variables_are_not_compared_but_a_variable_named_iter_elsewhere_is() {
        let with = |extra: Vec<(Node, Node)>| {
            let Node::Dict(mut top) = state(array(Blob::default()), 3, 1.5) else {
                unreachable!()
            };
            let Node::Dict(vars) = &mut top[3].1 else {
                unreachable!()
            };
            vars.extend(extra);
            Node::Dict(top)
        };
        let start = |v: i64| (s(START_VARS), Node::Dict(vec![(s("epoch"), Node::Int(v))]));
        let rec = with(vec![start(1)]);
        // Kept by the recording only, kept by both and different: not compared.
        assert_eq!(check_state(&rec, &with(vec![]), &[]).first, None);
        assert_eq!(check_state(&rec, &with(vec![start(2)]), &[]).first, None);
        // A script's own variable `iter` deeper down is state like any other.
        let nested = |v: i64| (s("m"), Node::Dict(vec![(s(START_VARS), Node::Int(v))]));
        let d = check_state(&with(vec![nested(1)]), &with(vec![nested(2)]), &[])
            .first
            .unwrap();
        assert_eq!(d.path, "vars/m/iter");
    }

    #[test]
    fn how_an_object_was_made_is_not_compared_but_what_it_holds_is() {
        // A kept DataLoader iterator: its creation RNG states (with a blob)
        // under ORIGIN, its position beside them, then a tensor.
        let it = |origin: i64, pos: i64, rng: Node| {
            Node::Dict(vec![(
                s("vars"),
                Node::Dict(vec![
                    (
                        s("data_iter"),
                        Node::Dict(vec![
                            (
                                s(ORIGIN),
                                Node::Dict(vec![(s("seed"), Node::Int(origin)), (s("torch"), rng)]),
                            ),
                            (s("yielded"), Node::Int(pos)),
                        ]),
                    ),
                    (s("w"), array(Blob::default())),
                ]),
            )])
        };
        let rec = |origin: i64, pos: i64| {
            let Node::Dict(mut top) = it(origin, pos, recorded_array(b"rng-a", 5)) else {
                unreachable!()
            };
            let Node::Dict(vars) = &mut top[0].1 else {
                unreachable!()
            };
            vars[1].1 = recorded_array(&W, 8);
            Node::Dict(top)
        };
        let live = |pos: i64| it(2, pos, array(Blob::default()));
        // Another origin (and other origin bytes) passes; the tensor after it
        // is still compared against its own bytes.
        assert_eq!(
            check_state(&rec(1, 5), &live(5), &[b"rng-b", &W]).first,
            None
        );
        let mut other = W;
        other[0] ^= 1;
        let d = check_state(&rec(1, 5), &live(5), &[b"rng-b", &other])
            .first
            .unwrap();
        assert_eq!(d.path, "vars/w");
        // The position beside the origin is compared.
        let d = check_state(&rec(1, 5), &live(6), &[b"rng-a", &W])
            .first
            .unwrap();
        assert_eq!(d.path, "vars/data_iter/yielded");
    }

    #[test]
    fn a_float_outside_the_loop_variables_and_a_kind_change_are_failures() {
        let mk = |v: Node| Node::Dict(vec![(s("rng"), Node::Dict(vec![(s("x"), v)]))]);
        let d = check_state(
            &mk(Node::Float(1f64.to_bits())),
            &mk(Node::Float(2f64.to_bits())),
            &[],
        )
        .first
        .unwrap();
        assert_eq!(d.path, "rng/x");
        let d = check_state(&mk(Node::Int(1)), &mk(Node::Float(1f64.to_bits())), &[])
            .first
            .unwrap();
        assert_eq!(d.detail, "recorded a int, live a float");
    }
}
