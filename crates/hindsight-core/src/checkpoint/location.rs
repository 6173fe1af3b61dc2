//! Where a store lives: the one place that tells an object store's URL
//! (`s3://`) from a directory, and splits the URL into its scheme, bucket and
//! prefix. Stores, the CLI, the binding and `hs.checkpointing` all parse
//! locations here; `checkpoint::object` turns a scheme into a client.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A parsed store location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A directory, absolute (`~` expanded, relative paths joined to the
    /// current directory; symlinks are left for the store to judge).
    Local(PathBuf),
    /// An object store: `s3://bucket[/prefix]`, `az://container[/prefix]`.
    Object(ObjectUrl),
}

/// The object stores a location may name, by URL scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    /// Amazon S3 and S3-compatible servers (MinIO, R2, moto).
    S3,
    /// Azure Blob Storage (and Azurite): `az://container/prefix`.
    Azure,
    /// An XRootD server: `root://host[:port]//path` (the "bucket" is the
    /// host, the prefix an absolute path on it).
    Xrootd,
}

impl Scheme {
    pub const ALL: [Scheme; 3] = [Scheme::S3, Scheme::Azure, Scheme::Xrootd];

    /// What precedes `://`.
    pub fn name(self) -> &'static str {
        match self {
            Scheme::S3 => "s3",
            Scheme::Azure => "az",
            Scheme::Xrootd => "root",
        }
    }
}

/// `SCHEME://BUCKET[/PREFIX]`, the prefix without slashes at either end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectUrl {
    pub scheme: Scheme,
    pub bucket: String,
    pub prefix: String,
}

impl ObjectUrl {
    /// Parse `text`, which must start with a known scheme's `SCHEME://`;
    /// `what` names the argument in errors.
    pub fn parse(text: &str, what: &str) -> Result<ObjectUrl> {
        let Some((scheme, rest)) = Scheme::ALL
            .iter()
            .find_map(|s| Some((*s, text.strip_prefix(s.name())?.strip_prefix("://")?)))
        else {
            return Err(Error::invalid(
                what,
                format!("{text:?}: not an object store URL ({})", known_schemes()),
            ));
        };
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let prefix = prefix.trim_matches('/');
        if bucket.is_empty() || bucket.contains(['?', '#']) || prefix.contains(['?', '#']) {
            let s = scheme.name();
            return Err(Error::invalid(
                what,
                format!("{text:?}: give {s}://bucket or {s}://bucket/prefix"),
            ));
        }
        Ok(ObjectUrl {
            scheme,
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
        })
    }

    /// `SCHEME://BUCKET`: the root object keys are named under. XRootD's
    /// ends in `/`, so that a key after one more `/` is an absolute path
    /// (`root://host//path`: a single slash would make it relative).
    pub fn root(&self) -> String {
        match self.scheme {
            Scheme::Xrootd => format!("root://{}/", self.bucket),
            _ => format!("{}://{}", self.scheme.name(), self.bucket),
        }
    }
}

impl fmt::Display for ObjectUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.root())?;
        if !self.prefix.is_empty() {
            write!(f, "/{}", self.prefix)?;
        }
        Ok(())
    }
}

fn known_schemes() -> String {
    let names: Vec<String> = Scheme::ALL
        .iter()
        .map(|s| format!("{}://", s.name()))
        .collect();
    names.join(", ")
}

impl Location {
    /// Parse `text`; `what` names the argument in errors (`store`,
    /// `local_first`, `$HINDSIGHT_STORE`).
    pub fn parse(text: &str, what: &str) -> Result<Location> {
        if text.is_empty() {
            return Err(Error::invalid(what, "empty store location"));
        }
        if text.contains("://") && Scheme::ALL.iter().any(|sc| text.starts_with(sc.name())) {
            return Ok(Location::Object(ObjectUrl::parse(text, what)?));
        }
        // Look-alikes of an S3 URL must not quietly become local directories.
        let lower = text.to_ascii_lowercase();
        if lower.starts_with("s3:") {
            return Err(Error::invalid(
                what,
                format!(
                    "{text:?} is not an S3 URL: write s3://bucket/prefix (lower case, two slashes)"
                ),
            ));
        }
        if text.contains("://") {
            return Err(Error::invalid(
                what,
                format!(
                    "{text:?}: only local directories and object store URLs ({}) are supported",
                    known_schemes()
                ),
            ));
        }
        let path = expand_home(text);
        let abs = if path.is_absolute() {
            path
        } else {
            std::env::current_dir()
                .map_err(|e| Error::io(".", e))?
                .join(path)
        };
        Ok(Location::Local(abs))
    }

    /// Parse a location that must be a local directory (a local-first cache).
    pub fn parse_local(text: &str, what: &str) -> Result<PathBuf> {
        match Location::parse(text, what)? {
            Location::Local(p) => Ok(p),
            Location::Object(_) => Err(Error::invalid(
                what,
                format!("{text:?}: must be a local directory"),
            )),
        }
    }

    pub fn is_local(&self) -> bool {
        matches!(self, Location::Local(_))
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Local(p) => write!(f, "{}", p.display()),
            Location::Object(url) => url.fmt(f),
        }
    }
}

fn expand_home(text: &str) -> PathBuf {
    if text == "~" || text.starts_with("~/") {
        if let Some(home) = std::env::var_os("HOME") {
            return Path::new(&home).join(text.trim_start_matches('~').trim_start_matches('/'));
        }
    }
    PathBuf::from(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_urls_split_into_scheme_bucket_and_prefix() {
        assert_eq!(
            Location::parse("s3://b/p/q/", "store").unwrap(),
            Location::Object(ObjectUrl {
                scheme: Scheme::S3,
                bucket: "b".into(),
                prefix: "p/q".into()
            })
        );
        assert_eq!(
            Location::parse("s3://b/p/", "store").unwrap().to_string(),
            "s3://b/p"
        );
        assert_eq!(
            Location::parse("s3://b", "store").unwrap().to_string(),
            "s3://b"
        );
        // XRootD: the host is the bucket; one slash or two, the path is absolute.
        for text in ["root://h:1094//data/ckpt/", "root://h:1094/data/ckpt"] {
            let loc = Location::parse(text, "store").unwrap();
            assert_eq!(
                loc,
                Location::Object(ObjectUrl {
                    scheme: Scheme::Xrootd,
                    bucket: "h:1094".into(),
                    prefix: "data/ckpt".into()
                })
            );
            assert_eq!(loc.to_string(), "root://h:1094//data/ckpt");
        }
    }

    #[test]
    fn bad_locations_name_the_argument() {
        for bad in [
            "", "s3://", "s3:///x", "gs://b/p", "http://x", "S3://b/p", "s3:/b/p", "s3:b",
            "s3://b?x", "s3x://b",
        ] {
            let e = Location::parse(bad, "local_first").unwrap_err();
            assert_eq!(e.arg(), Some("local_first"), "{bad}: {e}");
        }
        let e = Location::parse_local("s3://b", "local_first").unwrap_err();
        assert!(e.to_string().contains("local directory"), "{e}");
    }

    #[test]
    fn directories_become_absolute() {
        let Location::Local(p) = Location::parse("rel/dir", "store").unwrap() else {
            panic!("not local")
        };
        assert!(p.is_absolute());
        assert!(p.ends_with("rel/dir"));
    }
}
