//! The input service's secret. Every RPC to a dispatcher or a worker
//! carries it (`authorization: Bearer <token>`), and every server checks it
//! before any handler runs, so a caller without it learns nothing: not the
//! workers, not a job's dataset, not a byte of data, and it cannot register.
//!
//! One token per dispatcher (a deployment: its journal). The dispatcher
//! takes `$HINDSIGHT_DATA_TOKEN`, else the token file its journal keeps
//! (`<journal>/token`, created mode 0600 with 32 random bytes on first
//! start, kept across restarts so workers and trainers stay valid). Workers
//! and trainers read `$HINDSIGHT_DATA_TOKEN` or `$HINDSIGHT_DATA_TOKEN_FILE`;
//! a local loader hands its own workers the token itself.

use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hindsight_core::settings;
use subtle::ConstantTimeEq;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::service::Interceptor;
use tonic::transport::Channel;
use tonic::{Request, Status};

use crate::error::{Error, Result};

const HEADER: &str = "authorization";
const SCHEME: &str = "Bearer ";
/// The file a dispatcher's journal keeps its token in.
pub const TOKEN_FILE: &str = "token";
/// A token shorter than this is guessable; longer than this is no token.
const MIN_LEN: usize = 16;
const MAX_LEN: usize = 512;
/// What an unauthenticated caller is told: nothing about the service.
const REFUSAL: &str = "the input service's token is missing or wrong \
     (give it with HINDSIGHT_DATA_TOKEN or HINDSIGHT_DATA_TOKEN_FILE)";

/// A service token. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Token(Arc<str>);

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(..)")
    }
}

impl Token {
    /// 32 bytes from the operating system's random source, as hex.
    pub fn generate() -> Result<Token> {
        let mut bytes = [0u8; 32];
        getrandom::fill(&mut bytes).map_err(|e| Error::Io {
            what: "draw the input service's token".into(),
            source: std::io::Error::other(e.to_string()),
        })?;
        let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
        Ok(Token(hex.into()))
    }

    /// `text` (one line; surrounding whitespace ignored) as a token, or an
    /// error naming `source` and what is wrong, never the text itself.
    pub fn parse(text: &str, source: &str) -> Result<Token> {
        let t = text.trim();
        let bad = |why: &str| Error::Token(format!("the token in {source} {why}"));
        if t.len() < MIN_LEN {
            return Err(bad(&format!(
                "is shorter than {MIN_LEN} characters (empty, or guessable)"
            )));
        }
        if t.len() > MAX_LEN {
            return Err(bad(&format!("is longer than {MAX_LEN} characters")));
        }
        if !t.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(bad(
                "holds characters other than printable ASCII without spaces",
            ));
        }
        Ok(Token(t.into()))
    }

    /// The token in file `path`.
    pub fn read(path: &Path) -> Result<Token> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Io {
            what: format!("read the input service's token from {}", path.display()),
            source: e,
        })?;
        Token::parse(&text, &format!("{}", path.display()))
    }

    /// The token this process was given: `$HINDSIGHT_DATA_TOKEN`, else the
    /// file `$HINDSIGHT_DATA_TOKEN_FILE` names; `None` when neither is set.
    pub fn from_env() -> Result<Option<Token>> {
        if let Some(raw) = settings::DATA_TOKEN.raw().filter(|v| !v.is_empty()) {
            let text = raw.to_str().ok_or_else(|| {
                Error::Token(format!(
                    "the token in {} is not valid UTF-8",
                    settings::DATA_TOKEN.name
                ))
            })?;
            return Token::parse(text, settings::DATA_TOKEN.name).map(Some);
        }
        match settings::DATA_TOKEN_FILE.raw().filter(|v| !v.is_empty()) {
            Some(path) => Token::read(Path::new(&path)).map(Some),
            None => Ok(None),
        }
    }

    /// The token a client or worker must use: given, else from the
    /// environment, else an error saying where to get it.
    pub fn required(given: Option<Token>, role: &str) -> Result<Token> {
        match given {
            Some(t) => Ok(t),
            None => Token::from_env()?.ok_or_else(|| {
                Error::Token(format!(
                    "a {role} needs the service's token: set {} to its dispatcher's token file \
                     (<journal>/{TOKEN_FILE}, which the dispatcher names when it starts) \
                     or {} to the token",
                    settings::DATA_TOKEN_FILE.name,
                    settings::DATA_TOKEN.name
                ))
            }),
        }
    }

    /// A dispatcher's token: from the environment, else its journal's token
    /// file, created (mode 0600, never overwritten) if there is none yet.
    /// Returns the token and the file it is in, if any.
    pub fn for_dispatcher(journal_dir: &Path) -> Result<(Token, Option<PathBuf>)> {
        if let Some(t) = Token::from_env()? {
            return Ok((t, None));
        }
        let path = journal_dir.join(TOKEN_FILE);
        let created = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode_private()
            .open(&path);
        match created {
            Ok(mut f) => {
                let t = Token::generate()?;
                f.write_all(format!("{}\n", t.0).as_bytes())
                    .and_then(|_| f.sync_all())
                    .map_err(|e| Error::Io {
                        what: format!("write the input service's token to {}", path.display()),
                        source: e,
                    })?;
                Ok((t, Some(path)))
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                Ok((Token::read(&path)?, Some(path)))
            }
            Err(e) => Err(Error::Io {
                what: format!("create the input service's token file {}", path.display()),
                source: e,
            }),
        }
    }

    /// The token's text, to hand to a process this one starts.
    pub fn reveal(&self) -> &str {
        &self.0
    }

    fn header(&self) -> MetadataValue<Ascii> {
        // Printable ASCII (checked by `parse`, hex from `generate`) is a valid value.
        MetadataValue::try_from(format!("{SCHEME}{}", self.0)).expect("a token is printable ASCII")
    }
}

trait ModePrivate {
    fn mode_private(&mut self) -> &mut Self;
}

impl ModePrivate for std::fs::OpenOptions {
    fn mode_private(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt;
        self.mode(0o600)
    }
}

/// A client's side: adds the token to every call.
#[derive(Clone)]
pub struct Bearer(MetadataValue<Ascii>);

impl fmt::Debug for Bearer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Bearer(..)")
    }
}

impl Bearer {
    pub fn new(token: &Token) -> Bearer {
        Bearer(token.header())
    }
}

impl Interceptor for Bearer {
    fn call(&mut self, mut req: Request<()>) -> std::result::Result<Request<()>, Status> {
        req.metadata_mut().insert(HEADER, self.0.clone());
        Ok(req)
    }
}

/// A channel whose calls carry the token.
pub type Authed = InterceptedService<Channel, Bearer>;

/// A server's side: refuses every call without the token, in constant time
/// over its bytes, before the call's handler sees it.
#[derive(Clone)]
pub struct Check(Arc<[u8]>);

impl fmt::Debug for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Check(..)")
    }
}

impl Check {
    pub fn new(token: &Token) -> Check {
        Check(token.header().as_bytes().into())
    }
}

impl Interceptor for Check {
    fn call(&mut self, req: Request<()>) -> std::result::Result<Request<()>, Status> {
        let given = req.metadata().get(HEADER).map(|v| v.as_bytes());
        match given {
            Some(g) if bool::from(g.ct_eq(&self.0)) => Ok(req),
            _ => Err(Status::unauthenticated(REFUSAL)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_is_checked_whole_and_never_shown() {
        let t = Token::generate().unwrap();
        assert_eq!(t.reveal().len(), 64);
        assert_ne!(t, Token::generate().unwrap());
        assert_eq!(format!("{t:?}"), "Token(..)");
        let mut check = Check::new(&t);
        let call = |token: Option<&Token>| {
            let mut r = Request::new(());
            if let Some(tok) = token {
                r = Bearer::new(tok).call(r).unwrap();
            }
            r
        };
        assert!(check.call(call(Some(&t))).is_ok());
        let other = Token::parse(&format!("{}x", &t.reveal()[..63]), "test").unwrap();
        for refused in [call(None), call(Some(&other))] {
            let s = check.call(refused).unwrap_err();
            assert_eq!(s.code(), tonic::Code::Unauthenticated);
            assert!(!s.message().contains(t.reveal()));
        }
        // A prefix of the right header is not the header.
        let mut r = Request::new(());
        let header = t.header();
        let cut = &header.to_str().unwrap()[..20];
        r.metadata_mut().insert(HEADER, cut.parse().unwrap());
        assert!(check.call(r).is_err());
    }

    #[test]
    fn a_bad_token_is_named_by_its_source_not_echoed() {
        for (text, says) in [
            ("", "shorter than"),
            ("q7z", "shorter than"),
            ("has a space in the middle!", "printable ASCII"),
        ] {
            let e = Token::parse(text, "HINDSIGHT_DATA_TOKEN")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("HINDSIGHT_DATA_TOKEN") && e.contains(says),
                "{e}"
            );
            assert!(text.is_empty() || !e.contains(text), "{e}");
        }
        assert!(Token::parse("  0123456789abcdef\n", "x").is_ok());
    }

    #[test]
    fn a_dispatcher_keeps_its_token_across_restarts_in_a_private_file() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        // (No HINDSIGHT_DATA_TOKEN in the test environment.)
        if Token::from_env().unwrap().is_some() {
            return;
        }
        let (first, path) = Token::for_dispatcher(dir.path()).unwrap();
        let path = path.unwrap();
        assert_eq!(path, dir.path().join(TOKEN_FILE));
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o077, 0, "{mode:o}");
        let (again, _) = Token::for_dispatcher(dir.path()).unwrap();
        assert_eq!(first, again);
        assert_eq!(Token::read(&path).unwrap(), first);
    }
}
