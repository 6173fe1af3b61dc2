//! On-disk format, version 1 (see docs/format.md). Two kinds of files:
//!
//! * chunk: `HSC1` | codec u8 | 3 zero bytes | raw length u64 LE | payload.
//!   Named by the BLAKE3 hash of the *raw* (uncompressed) bytes, so equal
//!   content is stored once whatever the codec, and every read is verified.
//! * manifest: `HSM1` | format version u32 LE | body length u64 LE | JSON body |
//!   BLAKE3 of everything before it (32 bytes).

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub const FORMAT_VERSION: u32 = 1;
pub const CHUNK_MAGIC: &[u8; 4] = b"HSC1";
pub const MANIFEST_MAGIC: &[u8; 4] = b"HSM1";
pub const CHUNK_HEADER_LEN: usize = 16;
/// Upper bound on a manifest body; a larger length field means corruption.
const MAX_MANIFEST_BODY: u64 = 1 << 32;

/// Content address of a chunk: BLAKE3-256 of its raw bytes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkId(pub [u8; 32]);

impl ChunkId {
    pub fn of(raw: &[u8]) -> Self {
        ChunkId(*blake3::hash(raw).as_bytes())
    }

    pub fn to_hex(&self) -> String {
        let mut s = String::with_capacity(64);
        for b in self.0 {
            s.push_str(&format!("{b:02x}"));
        }
        s
    }

    pub fn from_hex(s: &str) -> Option<Self> {
        if s.len() != 64 || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        let mut out = [0u8; 32];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
        }
        Some(ChunkId(out))
    }
}

impl fmt::Debug for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ChunkId({})", &self.to_hex()[..16])
    }
}

impl fmt::Display for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl Serialize for ChunkId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_hex())
    }
}

impl<'de> Deserialize<'de> for ChunkId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ChunkId::from_hex(&s).ok_or_else(|| serde::de::Error::custom(format!("bad chunk id {s:?}")))
    }
}

/// How a chunk's payload is encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Codec {
    Raw = 0,
    Zstd = 1,
}

impl Codec {
    fn from_byte(b: u8) -> Option<Self> {
        match b {
            0 => Some(Codec::Raw),
            1 => Some(Codec::Zstd),
            _ => None,
        }
    }
}

pub fn chunk_header(codec: Codec, raw_len: u64) -> [u8; CHUNK_HEADER_LEN] {
    let mut h = [0u8; CHUNK_HEADER_LEN];
    h[..4].copy_from_slice(CHUNK_MAGIC);
    h[4] = codec as u8;
    h[8..].copy_from_slice(&raw_len.to_le_bytes());
    h
}

pub fn parse_chunk_header(h: &[u8], path: &Path) -> Result<(Codec, u64)> {
    if h.len() < CHUNK_HEADER_LEN || &h[..4] != CHUNK_MAGIC {
        return Err(Error::corrupt(path, "not a hindsight chunk (bad magic)"));
    }
    let codec = Codec::from_byte(h[4])
        .ok_or_else(|| Error::corrupt(path, format!("unknown codec {}", h[4])))?;
    // Reserved bytes are written as zeros; anything else is damage the
    // content hash (over the raw bytes) would not see.
    if h[5..8] != [0, 0, 0] {
        return Err(Error::corrupt(
            path,
            "chunk header: reserved bytes are not zero",
        ));
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(&h[8..16]);
    Ok((codec, u64::from_le_bytes(len)))
}

/// A reference to one chunk and the number of raw bytes taken from it: the
/// whole chunk, or a slice of a pack (a chunk holding several small blobs).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChunkRef {
    pub id: ChunkId,
    pub len: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pack: Option<PackSlice>,
}

/// Where a ref's bytes lie in a pack chunk. A reader verifies the whole pack
/// (its id) and the slice (`own`, the BLAKE3 of these bytes alone: what a
/// state check compares a live tensor with).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PackSlice {
    /// Offset of the slice in the pack's raw bytes.
    pub at: u64,
    /// The pack's raw length.
    pub of: u64,
    pub own: ChunkId,
}

impl ChunkRef {
    /// A whole chunk.
    pub fn whole(id: ChunkId, len: u64) -> Self {
        ChunkRef {
            id,
            len,
            pack: None,
        }
    }

    /// `len` bytes at `at` of the pack `id` (raw length `of`), whose own hash is `own`.
    pub fn packed(id: ChunkId, of: u64, at: u64, len: u64, own: ChunkId) -> Self {
        ChunkRef {
            id,
            len,
            pack: Some(PackSlice { at, of, own }),
        }
    }

    /// The raw length of the chunk file this ref reads.
    pub fn chunk_len(&self) -> u64 {
        self.pack.map_or(self.len, |p| p.of)
    }

    /// The id of these bytes alone (a pack slice's own hash).
    pub fn content_id(&self) -> ChunkId {
        self.pack.map_or(self.id, |p| p.own)
    }
}

/// A byte string stored as a sequence of chunks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct Blob {
    pub nbytes: u64,
    pub chunks: Vec<ChunkRef>,
    /// While a save is in flight: which of its staged chunks make up this
    /// blob; resolved into `chunks` when the save commits.
    #[serde(skip)]
    pub pending: Option<Pending>,
}

/// The chunk refs of one save, known once its background work hashed them.
#[derive(Debug, Default)]
pub struct StagedChunks {
    pub refs: std::sync::OnceLock<Vec<ChunkRef>>,
    /// The save failed or was abandoned: its chunks will never be known, so
    /// a later save must not reuse its blobs.
    pub failed: std::sync::atomic::AtomicBool,
}

impl Blob {
    /// The chunks of this blob: its own, or those of the save it is pending
    /// in once that save has hashed them (None while still unknown).
    pub fn known_chunks(&self) -> Option<&[ChunkRef]> {
        match &self.pending {
            None => Some(&self.chunks),
            Some(p) => p.chunks.refs.get().and_then(|all| all.get(p.range.clone())),
        }
    }

    /// This blob belongs to a save that failed: reusing it cannot work.
    pub fn from_failed_save(&self) -> bool {
        self.pending
            .as_ref()
            .is_some_and(|p| p.chunks.failed.load(std::sync::atomic::Ordering::Acquire))
    }
}

#[derive(Clone, Debug)]
pub struct Pending {
    pub chunks: std::sync::Arc<StagedChunks>,
    pub range: std::ops::Range<usize>,
}

impl PartialEq for Pending {
    fn eq(&self, other: &Self) -> bool {
        std::sync::Arc::ptr_eq(&self.chunks, &other.chunks) && self.range == other.range
    }
}
impl Eq for Pending {}

/// Which library an array belongs to, so load gives back the same kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ArrayLib {
    Torch,
    Numpy,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Array {
    pub lib: ArrayLib,
    /// torch: the name after `torch.` (e.g. `bfloat16`); numpy: `dtype.str` (e.g. `<f4`).
    pub dtype: String,
    pub shape: Vec<u64>,
    /// Always "little" in version 1 (arrays are converted on save if needed).
    pub byte_order: String,
    /// The device the tensor lived on at save time (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    pub data: Blob,
}

/// One rank's piece of an array several ranks saved: its place in the
/// whole array and its own bytes (row-major, like any array).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    /// Where the piece starts in the whole array, per dimension.
    pub offset: Vec<u64>,
    /// The piece itself (its `shape` is the piece's extent).
    pub array: Array,
}

/// An array saved in pieces (by the ranks of a sharded model): the pieces
/// tile the whole `shape` without overlap once every rank's part is merged
/// (`checkpoint::shard`); one rank's part holds its own pieces only.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sharded {
    pub shape: Vec<u64>,
    pub shards: Vec<Shard>,
}

/// The structure of a checkpoint: a tree of plain values and arrays.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "t", content = "v", rename_all = "lowercase")]
pub enum Node {
    None,
    Bool(bool),
    Int(i64),
    /// An integer outside i64, in decimal.
    BigInt(String),
    /// IEEE-754 bits, so NaN payloads and infinities survive JSON.
    Float(u64),
    Str(String),
    Bytes(Blob),
    List(Vec<Node>),
    Tuple(Vec<Node>),
    Dict(Vec<(Node, Node)>),
    Array(Box<Array>),
    /// Pickled bytes of an object the caller explicitly allowed to pickle.
    Pickle(Blob),
    /// An array saved in pieces by several ranks.
    Sharded(Box<Sharded>),
}

impl Node {
    /// Render a dict key for key paths (`optim/state/0/exp_avg`).
    pub fn key_label(&self) -> String {
        match self {
            Node::Str(s) => s.clone(),
            Node::Int(i) => i.to_string(),
            Node::BigInt(s) => s.clone(),
            Node::Bool(b) => b.to_string(),
            Node::None => "None".into(),
            Node::Float(bits) => f64::from_bits(*bits).to_string(),
            Node::Tuple(items) => format!(
                "({})",
                items
                    .iter()
                    .map(|i| i.key_label())
                    .collect::<Vec<_>>()
                    .join(",")
            ),
            other => format!("<{}>", other.kind()),
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Node::None => "none",
            Node::Bool(_) => "bool",
            Node::Int(_) | Node::BigInt(_) => "int",
            Node::Float(_) => "float",
            Node::Str(_) => "str",
            Node::Bytes(_) => "bytes",
            Node::List(_) => "list",
            Node::Tuple(_) => "tuple",
            Node::Dict(_) => "dict",
            Node::Array(_) => "array",
            Node::Pickle(_) => "pickle",
            Node::Sharded(_) => "sharded array",
        }
    }

    /// Visit every blob with its key path.
    pub fn for_each_blob<'a>(
        &'a self,
        path: &mut Vec<String>,
        f: &mut dyn FnMut(&[String], &'a Blob),
    ) {
        match self {
            Node::Bytes(b) | Node::Pickle(b) => f(path, b),
            Node::Array(a) => f(path, &a.data),
            Node::Sharded(s) => s.shards.iter().for_each(|p| f(path, &p.array.data)),
            Node::List(items) | Node::Tuple(items) => {
                for (i, n) in items.iter().enumerate() {
                    path.push(i.to_string());
                    n.for_each_blob(path, f);
                    path.pop();
                }
            }
            Node::Dict(items) => {
                for (k, v) in items {
                    path.push(k.key_label());
                    v.for_each_blob(path, f);
                    path.pop();
                }
            }
            _ => {}
        }
    }

    pub fn for_each_blob_mut(&mut self, f: &mut dyn FnMut(&mut Blob)) {
        match self {
            Node::Bytes(b) | Node::Pickle(b) => f(b),
            Node::Array(a) => f(&mut a.data),
            Node::Sharded(s) => s.shards.iter_mut().for_each(|p| f(&mut p.array.data)),
            Node::List(items) | Node::Tuple(items) => {
                items.iter_mut().for_each(|n| n.for_each_blob_mut(f))
            }
            Node::Dict(items) => items.iter_mut().for_each(|(_, v)| v.for_each_blob_mut(f)),
            _ => {}
        }
    }

    /// The sub-tree at a key path, to change in place.
    fn select_mut(&mut self, path: &[String]) -> Option<&mut Node> {
        let Some((first, rest)) = path.split_first() else {
            return Some(self);
        };
        match self {
            Node::Dict(items) => items
                .iter_mut()
                .find(|(k, _)| &k.key_label() == first)?
                .1
                .select_mut(rest),
            Node::List(items) | Node::Tuple(items) => items
                .get_mut(first.parse::<usize>().ok()?)?
                .select_mut(rest),
            _ => None,
        }
    }

    /// Take the array at `path` (whole or in pieces) out of the tree, None
    /// in its place: its dtype and whole shape. None where `path` holds no
    /// array (the tree is left as it is).
    pub fn take_array(&mut self, path: &[String]) -> Option<(String, Vec<u64>)> {
        let node = self.select_mut(path)?;
        let found = match &*node {
            Node::Array(a) => (a.dtype.clone(), a.shape.clone()),
            Node::Sharded(s) => (s.shards.first()?.array.dtype.clone(), s.shape.clone()),
            _ => return None,
        };
        *node = Node::None;
        Some(found)
    }

    /// The sub-tree at a key path (each element matches a dict key label or a list index).
    pub fn select(&self, path: &[String]) -> Option<&Node> {
        let Some((first, rest)) = path.split_first() else {
            return Some(self);
        };
        match self {
            Node::Dict(items) => items
                .iter()
                .find(|(k, _)| &k.key_label() == first)?
                .1
                .select(rest),
            Node::List(items) | Node::Tuple(items) => {
                items.get(first.parse::<usize>().ok()?)?.select(rest)
            }
            _ => None,
        }
    }
}

/// One committed checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub name: String,
    /// Milliseconds since the Unix epoch when the save was requested.
    pub created_ms: u64,
    /// Free-form string metadata (e.g. the epoch, a metric) for tools and retention.
    #[serde(default)]
    pub meta: BTreeMap<String, String>,
    pub root: Node,
}

/// Manifest metadata: the save attempt of a multi-rank checkpoint whose
/// parts it merges (`shard` writes it; supersession reads it).
pub const META_ATTEMPT: &str = "hs.attempt";

impl Manifest {
    /// Whether committing this manifest over `existing` (the name's commit
    /// now, if any) is refused: a save of the name requested after this one
    /// (a newer `created_ms`, and for a multi-rank save another attempt)
    /// has committed while this one was written. Two jobs saving one name
    /// at once: the later request keeps the name, the earlier gets this
    /// error naming the conflict, never silently overwriting it with older
    /// state. (Compared by the requesters' clocks.)
    pub fn refuse_superseded(&self, existing: Option<&Manifest>) -> Result<()> {
        let Some(other) = existing else { return Ok(()) };
        let attempt = |m: &Manifest| m.meta.get(META_ATTEMPT).cloned();
        let same_attempt = attempt(self).is_some() && attempt(self) == attempt(other);
        if other.created_ms <= self.created_ms || same_attempt {
            return Ok(());
        }
        Err(Error::invalid(
            format!("checkpoint '{}'", self.name),
            format!(
                "another save of this name, requested {} ms after this one, was committed while this \
                 one was written (two jobs or processes saving one name at once?): this save is not \
                 committed, the other one is kept",
                other.created_ms - self.created_ms
            ),
        ))
    }

    pub fn encode(&self) -> Result<Vec<u8>> {
        // What decode would refuse is refused here, before anything is
        // committed: a listed checkpoint that cannot be read poisons the
        // store-wide operations (gc, usage) that must read every manifest.
        self.validate()
            .map_err(|d| Error::invalid("state", format!("checkpoint '{}': {d}", self.name)))?;
        self.encode_unchecked()
    }

    /// The manifest's bytes as they are (tests write hostile ones with it).
    fn encode_unchecked(&self) -> Result<Vec<u8>> {
        // Plain data serializes; if it ever did not, writing an empty
        // manifest would lose the checkpoint: report it instead.
        let body = serde_json::to_vec(self).map_err(|e| {
            Error::internal(format!("manifest '{}' did not serialize: {e}", self.name))
        })?;
        let mut out = Vec::with_capacity(body.len() + 48);
        out.extend_from_slice(MANIFEST_MAGIC);
        out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&(body.len() as u64).to_le_bytes());
        out.extend_from_slice(&body);
        let sum = blake3::hash(&out);
        out.extend_from_slice(sum.as_bytes());
        Ok(out)
    }

    /// Decode and verify a manifest file. Never panics on any input.
    pub fn decode(bytes: &[u8], path: &Path) -> Result<Self> {
        let bad = |d: String| Error::corrupt(path, d);
        if bytes.len() < 16 + 32 || &bytes[..4] != MANIFEST_MAGIC {
            return Err(bad(
                "not a hindsight manifest (bad magic or truncated)".into()
            ));
        }
        let version = u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]);
        if version != FORMAT_VERSION {
            return Err(bad(format!(
                "format version {version} is not supported by this hindsight (reads version {FORMAT_VERSION})"
            )));
        }
        let mut len = [0u8; 8];
        len.copy_from_slice(&bytes[8..16]);
        let len = u64::from_le_bytes(len);
        if len > MAX_MANIFEST_BODY || 16 + len + 32 != bytes.len() as u64 {
            return Err(bad(format!(
                "length field {len} does not match file size {}",
                bytes.len()
            )));
        }
        let split = bytes.len() - 32;
        if blake3::hash(&bytes[..split]).as_bytes() != &bytes[split..] {
            return Err(bad("manifest checksum mismatch".into()));
        }
        let m: Manifest = serde_json::from_slice(&bytes[16..split])
            .map_err(|e| bad(format!("manifest does not parse: {e}")))?;
        m.validate().map_err(bad)?;
        Ok(m)
    }

    /// Every chunk id a manifest of this format version may reference, found
    /// without parsing it (any quoted 64-digit hex string): an
    /// over-approximation that keeps gc safe around a manifest that does not
    /// decode. None when the file is not a manifest of this version (a newer
    /// hindsight's: what it references cannot be known).
    pub fn scan_chunk_ids(bytes: &[u8]) -> Option<Vec<ChunkId>> {
        if bytes.len() < 16 || &bytes[..4] != MANIFEST_MAGIC {
            return None;
        }
        if u32::from_le_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]) != FORMAT_VERSION {
            return None;
        }
        let mut ids = Vec::new();
        let body = &bytes[16..];
        let mut i = 0;
        while i + 66 <= body.len() {
            if body[i] == b'"' && body[i + 65] == b'"' {
                if let Some(id) = std::str::from_utf8(&body[i + 1..i + 65])
                    .ok()
                    .and_then(ChunkId::from_hex)
                {
                    ids.push(id);
                    i += 66;
                    continue;
                }
            }
            i += 1;
        }
        Some(ids)
    }

    /// Structural checks a checksum cannot give (a manifest written by a
    /// buggy or hostile writer): every length with checked arithmetic, the
    /// node grammar (dict keys are scalars or tuples of them), integers,
    /// dtypes and shapes that Python can build.
    fn validate(&self) -> Result<(), String> {
        validate_node(&self.root, &mut Vec::new(), 0)
    }
}

/// The largest chunk any store writes (`chunk_size` is at most 1 GiB).
pub const MAX_CHUNK_LEN: u64 = 1 << 30;
/// Python refuses to parse longer decimal integers by default.
const MAX_BIGINT_DIGITS: usize = 4300;
/// The deepest nesting of a state tree a checkpoint holds, checked at save
/// and at load: one owner, so a save never commits what load refuses. The
/// manifest's JSON must stay within serde_json's 128 levels, and each dict
/// level of the tree takes three of them.
pub const MAX_TREE_DEPTH: usize = 32;

fn validate_blob(b: &Blob, path: &[String]) -> Result<(), String> {
    let mut sum: u64 = 0;
    for c in &b.chunks {
        if c.len == 0 || c.len > MAX_CHUNK_LEN {
            return Err(format!(
                "blob at '{}' has a chunk of {} bytes (allowed: 1..={MAX_CHUNK_LEN})",
                path.join("/"),
                c.len
            ));
        }
        if let Some(p) = c.pack {
            if p.of > MAX_CHUNK_LEN || p.at.checked_add(c.len).is_none_or(|end| end > p.of) {
                return Err(format!(
                    "blob at '{}' takes bytes {}..+{} of a pack of {} bytes",
                    path.join("/"),
                    p.at,
                    c.len,
                    p.of
                ));
            }
        }
        sum = sum
            .checked_add(c.len)
            .ok_or_else(|| format!("chunk lengths of '{}' overflow", path.join("/")))?;
    }
    if sum != b.nbytes {
        return Err(format!(
            "blob at '{}' has {sum} bytes in chunks but claims {}",
            path.join("/"),
            b.nbytes
        ));
    }
    Ok(())
}

fn validate_bigint(s: &str, path: &[String]) -> Result<(), String> {
    let digits = s.strip_prefix('-').unwrap_or(s);
    if digits.is_empty()
        || digits.len() > MAX_BIGINT_DIGITS
        || !digits.bytes().all(|c| c.is_ascii_digit())
    {
        return Err(format!(
            "integer at '{}' is not a decimal of at most {MAX_BIGINT_DIGITS} digits",
            path.join("/")
        ));
    }
    Ok(())
}

/// Dict keys: what Python can hash and we can label.
fn validate_key(k: &Node, path: &[String]) -> Result<(), String> {
    match k {
        Node::None | Node::Bool(_) | Node::Int(_) | Node::Float(_) | Node::Str(_) => Ok(()),
        Node::BigInt(s) => validate_bigint(s, path),
        Node::Tuple(items) => items.iter().try_for_each(|i| validate_key(i, path)),
        other => Err(format!(
            "a {} is used as a dict key at '{}'",
            other.kind(),
            path.join("/")
        )),
    }
}

fn validate_node(node: &Node, path: &mut Vec<String>, depth: usize) -> Result<(), String> {
    if depth > MAX_TREE_DEPTH {
        return Err(format!(
            "nesting deeper than {MAX_TREE_DEPTH} levels at '{}'",
            path.join("/")
        ));
    }
    match node {
        Node::None | Node::Bool(_) | Node::Int(_) | Node::Float(_) | Node::Str(_) => Ok(()),
        Node::BigInt(s) => validate_bigint(s, path),
        Node::Bytes(b) | Node::Pickle(b) => validate_blob(b, path),
        Node::Array(a) => validate_array(a, path),
        Node::Sharded(sh) => validate_sharded(sh, path),
        Node::List(items) | Node::Tuple(items) => {
            items.iter().enumerate().try_for_each(|(i, n)| {
                path.push(i.to_string());
                let r = validate_node(n, path, depth + 1);
                path.pop();
                r
            })
        }
        Node::Dict(items) => items.iter().try_for_each(|(k, v)| {
            validate_key(k, path)?;
            path.push(k.key_label());
            let r = validate_node(v, path, depth + 1);
            path.pop();
            r
        }),
    }
}

fn validate_array(a: &Array, path: &[String]) -> Result<(), String> {
    validate_blob(&a.data, path)?;
    let item = itemsize(a.lib, &a.dtype)
        .ok_or_else(|| format!("unknown dtype {:?} at '{}'", a.dtype, path.join("/")))?;
    if a.byte_order != "little" {
        return Err(format!(
            "byte order {:?} at '{}' (only \"little\" is written)",
            a.byte_order,
            path.join("/")
        ));
    }
    // numpy and torch refuse a shape whose non-zero extents overflow
    // their index type even when another extent is 0 (`[0, 2**63-1]`).
    let addressable = a
        .shape
        .iter()
        .filter(|&&d| d != 0)
        .try_fold(item, |acc, &d| acc.checked_mul(d))
        .is_some_and(|n| n <= i64::MAX as u64);
    if a.shape.len() > 64 || !addressable {
        return Err(format!(
            "shape {:?} at '{}' is not one an array can have",
            a.shape,
            path.join("/")
        ));
    }
    let n = a
        .shape
        .iter()
        .try_fold(item, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| format!("shape overflows at '{}'", path.join("/")))?;
    if n != a.data.nbytes {
        return Err(format!(
            "array at '{}' of dtype {} and shape {:?} needs {n} bytes but holds {}",
            path.join("/"),
            a.dtype,
            a.shape,
            a.data.nbytes
        ));
    }
    Ok(())
}

/// A sharded array's pieces: each a valid array of the whole's dtype and
/// rank, lying inside the whole. That they tile it is checked where pieces
/// are read and where parts are merged (a part holds some pieces only).
fn validate_sharded(sh: &Sharded, path: &[String]) -> Result<(), String> {
    let at = || path.join("/");
    if sh.shape.len() > 64 {
        return Err(format!(
            "shape {:?} at '{}' has too many dimensions",
            sh.shape,
            at()
        ));
    }
    let first = sh.shards.first();
    if let Some(f) = first {
        let whole = itemsize(f.array.lib, &f.array.dtype)
            .and_then(|item| sh.shape.iter().try_fold(item, |acc, &d| acc.checked_mul(d)));
        if whole.is_none_or(|n| n > i64::MAX as u64) {
            return Err(format!(
                "shape {:?} at '{}' is not one an array can have",
                sh.shape,
                at()
            ));
        }
    }
    for p in &sh.shards {
        validate_array(&p.array, path)?;
        let a = &p.array;
        if first.is_some_and(|f| f.array.lib != a.lib || f.array.dtype != a.dtype) {
            return Err(format!(
                "the pieces of the sharded array at '{}' differ in dtype",
                at()
            ));
        }
        let inside = p.offset.len() == sh.shape.len()
            && a.shape.len() == sh.shape.len()
            && p.offset
                .iter()
                .zip(&a.shape)
                .zip(&sh.shape)
                .all(|((&o, &n), &whole)| o.checked_add(n).is_some_and(|end| end <= whole));
        if !inside {
            return Err(format!(
                "a piece at offset {:?} of shape {:?} does not lie inside the sharded array of shape {:?} at '{}'",
                p.offset, a.shape, sh.shape, at()
            ));
        }
    }
    Ok(())
}

/// The torch dtypes the format holds (the name after `torch.`) and their
/// item sizes: the one table the Python layer asks before a save.
pub const TORCH_DTYPES: &[(&str, u64)] = &[
    ("bool", 1),
    ("uint8", 1),
    ("int8", 1),
    ("float8_e4m3fn", 1),
    ("float8_e5m2", 1),
    ("float8_e4m3fnuz", 1),
    ("float8_e5m2fnuz", 1),
    ("float8_e8m0fnu", 1),
    ("int16", 2),
    ("uint16", 2),
    ("float16", 2),
    ("bfloat16", 2),
    ("int32", 4),
    ("uint32", 4),
    ("float32", 4),
    ("complex32", 4),
    ("int64", 8),
    ("uint64", 8),
    ("float64", 8),
    ("complex64", 8),
    ("complex128", 16),
];

/// Bytes per element, or None for a dtype the format does not know.
pub fn itemsize(lib: ArrayLib, dtype: &str) -> Option<u64> {
    match lib {
        ArrayLib::Torch => TORCH_DTYPES
            .iter()
            .find(|(name, _)| *name == dtype)
            .map(|&(_, size)| size),
        // numpy dtype.str: byte order char, kind char, item size (e.g. "<f4", "|b1").
        ArrayLib::Numpy => {
            let b = dtype.as_bytes();
            if b.len() < 3
                || !matches!(b[0], b'<' | b'|')
                || !matches!(b[1], b'b' | b'i' | b'u' | b'f' | b'c')
            {
                return None;
            }
            let n = dtype[2..].parse::<u64>().ok()?;
            let ok = match b[1] {
                b'b' => n == 1,
                b'i' | b'u' => matches!(n, 1 | 2 | 4 | 8),
                b'f' => matches!(n, 2 | 4 | 8 | 16),
                _ => matches!(n, 8 | 16 | 32), // complex
            };
            ok.then_some(n)
        }
    }
}

/// Checkpoint names become file names: keep them portable and unambiguous.
pub fn validate_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"._-=+@,".contains(&c));
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(
            format!("checkpoint name {name:?}"),
            "use 1-200 characters from A-Z a-z 0-9 . _ - = + @ , not starting with '.'",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// What Python can use as a dict key (the format's key grammar).
    fn arb_key() -> impl Strategy<Value = Node> {
        let scalar = prop_oneof![
            Just(Node::None),
            any::<bool>().prop_map(Node::Bool),
            any::<i64>().prop_map(Node::Int),
            ".*".prop_map(Node::Str),
        ];
        prop_oneof![
            scalar.clone(),
            prop::collection::vec(scalar, 0..3).prop_map(Node::Tuple),
        ]
    }

    fn arb_blob() -> impl Strategy<Value = Blob> {
        prop::collection::vec(
            (
                any::<[u8; 32]>(),
                1u64..=MAX_CHUNK_LEN,
                any::<Option<(u64, [u8; 32])>>(),
            ),
            0..4,
        )
        .prop_map(|cs| {
            let chunks: Vec<ChunkRef> = cs
                .into_iter()
                .map(|(id, len, pack)| match pack {
                    None => ChunkRef::whole(ChunkId(id), len),
                    Some((at, own)) => {
                        let at = at % (MAX_CHUNK_LEN - len + 1);
                        ChunkRef::packed(ChunkId(id), at + len, at, len, ChunkId(own))
                    }
                })
                .collect();
            Blob {
                nbytes: chunks.iter().map(|c| c.len).sum(),
                chunks,
                pending: None,
            }
        })
    }

    fn arb_node() -> impl Strategy<Value = Node> {
        let leaf = prop_oneof![
            Just(Node::None),
            any::<bool>().prop_map(Node::Bool),
            any::<i64>().prop_map(Node::Int),
            "-?[1-9][0-9]{19,40}".prop_map(Node::BigInt),
            any::<u64>().prop_map(Node::Float),
            ".*".prop_map(Node::Str),
            arb_blob().prop_map(Node::Bytes),
            arb_blob().prop_map(Node::Pickle),
            (
                prop::collection::vec(0u64..5, 0..4),
                prop::sample::select(vec!["float32", "bfloat16", "bool", "int64"])
            )
                .prop_map(|(shape, dtype)| {
                    let n =
                        shape.iter().product::<u64>() * itemsize(ArrayLib::Torch, dtype).unwrap();
                    let chunks = if n == 0 {
                        vec![]
                    } else {
                        vec![ChunkRef::whole(ChunkId([7; 32]), n)]
                    };
                    Node::Array(Box::new(Array {
                        lib: ArrayLib::Torch,
                        dtype: dtype.into(),
                        shape,
                        byte_order: "little".into(),
                        device: Some("cpu".into()),
                        data: Blob {
                            nbytes: n,
                            chunks,
                            pending: None,
                        },
                    }))
                }),
        ];
        leaf.prop_recursive(4, 64, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Node::List),
                prop::collection::vec(inner.clone(), 0..6).prop_map(Node::Tuple),
                prop::collection::vec((arb_key(), inner), 0..6).prop_map(Node::Dict),
            ]
        })
    }

    proptest! {
        #[test]
        fn manifest_round_trips(root in arb_node(), name in "[a-z0-9_.-]{1,20}", created in any::<u64>()) {
            let m = Manifest { format: FORMAT_VERSION, name, created_ms: created, meta: BTreeMap::new(), root };
            let bytes = m.encode().unwrap();
            prop_assert_eq!(Manifest::decode(&bytes, Path::new("m")).unwrap(), m);
        }

        #[test]
        fn any_single_flipped_byte_is_detected(root in arb_node(), pos in any::<prop::sample::Index>(), bit in 0u8..8) {
            let m = Manifest { format: FORMAT_VERSION, name: "x".into(), created_ms: 1, meta: BTreeMap::new(), root };
            let mut bytes = m.encode().unwrap();
            let i = pos.index(bytes.len());
            bytes[i] ^= 1 << bit;
            prop_assert!(Manifest::decode(&bytes, Path::new("m")).is_err());
        }

        #[test]
        fn decode_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = Manifest::decode(&bytes, Path::new("m"));
        }
    }

    #[test]
    fn chunk_ids_round_trip_through_hex() {
        let id = ChunkId::of(b"abc");
        assert_eq!(ChunkId::from_hex(&id.to_hex()), Some(id));
        assert_eq!(ChunkId::from_hex("zz"), None);
    }

    #[test]
    fn names_are_checked() {
        assert!(validate_name("epoch-3").is_ok());
        for bad in ["", "../x", "a/b", ".hidden", "a b"] {
            let e = validate_name(bad).unwrap_err().to_string();
            assert!(e.contains("checkpoint name"), "{e}");
        }
    }

    #[test]
    fn array_size_mismatch_is_corruption() {
        let root = Node::Array(Box::new(Array {
            lib: ArrayLib::Torch,
            dtype: "float32".into(),
            shape: vec![3],
            byte_order: "little".into(),
            device: None,
            data: Blob {
                nbytes: 8,
                chunks: vec![ChunkRef::whole(ChunkId([0; 32]), 8)],
                pending: None,
            },
        }));
        let e = decode_error(root);
        assert!(e.contains("needs 12 bytes"), "{e}");
    }
    /// Why a manifest "x" holding `root`, written as it is, does not decode.
    fn decode_error(root: Node) -> String {
        let m = Manifest {
            format: FORMAT_VERSION,
            name: "x".into(),
            created_ms: 0,
            meta: BTreeMap::new(),
            root,
        };
        Manifest::decode(&m.encode_unchecked().unwrap(), Path::new("m"))
            .unwrap_err()
            .to_string()
    }

    fn nested(depth: usize) -> Manifest {
        let mut root = Node::Int(1);
        for i in 0..depth {
            root = Node::Dict(vec![(Node::Str(format!("k{i}")), root)]);
        }
        Manifest {
            format: FORMAT_VERSION,
            name: "deep".into(),
            created_ms: 0,
            meta: BTreeMap::new(),
            root,
        }
    }

    #[test]
    fn an_empty_array_whose_other_extents_overflow_is_corruption() {
        let root = Node::Array(Box::new(Array {
            lib: ArrayLib::Numpy,
            dtype: "<f4".into(),
            shape: vec![0, (1 << 63) - 1],
            byte_order: "little".into(),
            device: None,
            data: Blob::default(),
        }));
        let e = decode_error(root);
        assert!(e.contains("not one an array can have"), "{e}");
    }

    #[test]
    fn the_deepest_tree_a_save_accepts_loads_and_one_deeper_is_refused_at_save() {
        let m = nested(MAX_TREE_DEPTH);
        assert_eq!(
            Manifest::decode(&m.encode().unwrap(), Path::new("m")).unwrap(),
            m
        );
        let e = nested(MAX_TREE_DEPTH + 1).encode().unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument);
        let text = e.to_string();
        assert!(
            text.contains("checkpoint 'deep'") && text.contains("nesting deeper than"),
            "{text}"
        );
        assert!(text.contains("k32/k31"), "names where: {text}");
    }
}
