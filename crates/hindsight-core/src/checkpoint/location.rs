//! Where a store lives: the one place that tells an `s3://` URL from a
//! directory. Stores, the CLI, the binding and `hs.checkpointing` all parse
//! locations here.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// A parsed store location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Location {
    /// A directory, absolute (`~` expanded, relative paths joined to the
    /// current directory; symlinks are left for the store to judge).
    Local(PathBuf),
    /// `s3://bucket[/prefix]`, without a trailing slash.
    S3(String),
}

impl Location {
    /// Parse `text`; `what` names the argument in errors (`store`,
    /// `local_first`, `$HINDSIGHT_STORE`).
    pub fn parse(text: &str, what: &str) -> Result<Location> {
        if text.is_empty() {
            return Err(Error::invalid(what, "empty store location"));
        }
        if let Some(rest) = text.strip_prefix("s3://") {
            let rest = rest.trim_end_matches('/');
            if rest.is_empty() || rest.starts_with('/') {
                return Err(Error::invalid(
                    what,
                    format!("{text:?}: give s3://bucket or s3://bucket/prefix"),
                ));
            }
            return Ok(Location::S3(format!("s3://{rest}")));
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
                format!("{text:?}: only local directories and s3:// URLs are supported"),
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
            Location::S3(_) => Err(Error::invalid(
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
            Location::S3(url) => f.write_str(url),
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
    fn s3_urls_lose_the_trailing_slash() {
        assert_eq!(
            Location::parse("s3://b/p/", "store").unwrap(),
            Location::S3("s3://b/p".into())
        );
        assert_eq!(
            Location::parse("s3://b", "store").unwrap().to_string(),
            "s3://b"
        );
    }

    #[test]
    fn bad_locations_name_the_argument() {
        for bad in [
            "", "s3://", "s3:///x", "gs://b/p", "http://x", "S3://b/p", "s3:/b/p", "s3:b",
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
