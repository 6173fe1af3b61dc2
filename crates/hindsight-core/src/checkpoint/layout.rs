//! The names inside a store, the same for every backend (a local directory,
//! an S3 prefix): `chunks/ab/cdef…` (content address, fanned out by its first
//! byte), `manifests/NAME.hsm`, `tmp/`, `quarantine/`. Backends join these
//! parts their own way (paths, object keys); the names are decided here.

use crate::checkpoint::format::ChunkId;

pub const CHUNKS: &str = "chunks";
pub const MANIFESTS: &str = "manifests";
pub const TMP: &str = "tmp";
pub const QUARANTINE: &str = "quarantine";
const MANIFEST_EXT: &str = ".hsm";

/// (fan-out directory, file name) of a chunk under [`CHUNKS`].
pub fn chunk_parts(id: &ChunkId) -> (String, String) {
    let hex = id.to_hex();
    (hex[..2].to_string(), hex[2..].to_string())
}

/// The chunk a (fan-out directory, file name) pair under [`CHUNKS`] names.
pub fn chunk_from_parts(fan: &str, rest: &str) -> Option<ChunkId> {
    if fan.len() != 2 {
        return None;
    }
    ChunkId::from_hex(&format!("{fan}{rest}"))
}

/// The file name of checkpoint `name` under [`MANIFESTS`].
pub fn manifest_file(name: &str) -> String {
    format!("{name}{MANIFEST_EXT}")
}

/// The checkpoint a file under [`MANIFESTS`] holds (None: not a manifest).
pub fn manifest_name(file: &str) -> Option<&str> {
    file.strip_suffix(MANIFEST_EXT).filter(|n| !n.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        let id = ChunkId::of(b"x");
        let (fan, rest) = chunk_parts(&id);
        assert_eq!(chunk_from_parts(&fan, &rest), Some(id));
        assert_eq!(chunk_from_parts("a", &rest), None);
        assert_eq!(
            manifest_name(&manifest_file("run.epoch-000001")),
            Some("run.epoch-000001")
        );
        assert_eq!(manifest_name("notes.txt"), None);
        assert_eq!(manifest_name(".hsm"), None);
    }
}
