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
//!
//! Where one service feeds several jobs, trainers get a job token instead
//! ([`Token::for_dataset`], `hindsight data token --dataset D`): derived
//! from the service token with a keyed hash, so no server keeps a list, and
//! good only for jobs over dataset `D` (attaching, its assignments,
//! progress and digests, and reading its units from a worker). It cannot
//! register a worker, list the service, or touch another dataset's job.

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
/// A job token: `hsjob.<dataset, hex>.<keyed hash, hex>`.
const JOB_PREFIX: &str = "hsjob.";
/// What a job token's holder is told when it asks beyond its dataset.
const SCOPE_REFUSAL: &str = "this job token is not good for that call \
     (it serves its own dataset's jobs only: attach, assignments, progress and reading units)";

/// What a caller's token lets it do, as the server's check found it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Scope {
    /// The service's token: the dispatcher, its workers, an operator.
    Service,
    /// A job token: trainers of jobs over this dataset.
    Dataset(String),
}

impl Scope {
    /// Whether a call about `dataset` (`None`: about the service itself,
    /// such as registering a worker or listing them) is allowed.
    pub fn allows(&self, dataset: Option<&str>) -> bool {
        match self {
            Scope::Service => true,
            Scope::Dataset(d) => dataset == Some(d.as_str()),
        }
    }
}

/// Whether the caller of `request` (let in by the server's [`Check`]) may
/// make a call about `dataset`; else a `permission_denied` naming nothing secret.
pub fn allow<T>(request: &Request<T>, dataset: Option<&str>) -> std::result::Result<(), Status> {
    match request.extensions().get::<Scope>() {
        Some(scope) if scope.allows(dataset) => Ok(()),
        _ => Err(refused()),
    }
}

/// The caller's scope, as the server's [`Check`] found it.
pub fn scope<T>(request: &Request<T>) -> Option<Scope> {
    request.extensions().get::<Scope>().cloned()
}

/// The refusal of a call beyond the caller's scope.
pub fn refused() -> Status {
    Status::permission_denied(SCOPE_REFUSAL)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

/// The keyed hash binding a job token to its dataset, keyed by the service token.
fn dataset_mac(service: &Token, dataset: &str) -> [u8; 32] {
    let key = blake3::derive_key("hindsight data 2026-11 job token", service.0.as_bytes());
    *blake3::keyed_hash(&key, dataset.as_bytes()).as_bytes()
}
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

    /// The service's token as an operator holds it: `$HINDSIGHT_DATA_TOKEN`
    /// or `_FILE`, else the token file of the dispatcher's journal (never
    /// created here: the dispatcher draws it).
    pub fn of_service(journal_dir: Option<&Path>) -> Result<Token> {
        if let Some(t) = Token::from_env()? {
            return Ok(t);
        }
        match journal_dir {
            Some(dir) => Token::read(&dir.join(TOKEN_FILE)),
            None => Err(Error::Token(format!(
                "the service's token is needed: give the dispatcher's journal (its {TOKEN_FILE} file), \
                 or set {} or {}",
                settings::DATA_TOKEN_FILE.name,
                settings::DATA_TOKEN.name
            ))),
        }
    }

    /// The token's text, to hand to a process this one starts.
    pub fn reveal(&self) -> &str {
        &self.0
    }

    /// The job token for trainers of jobs over `dataset`, derived from this
    /// (the service's) token. An error where the name is too long for a token.
    pub fn for_dataset(&self, dataset: &str) -> Result<Token> {
        if dataset.is_empty() {
            return Err(Error::Token("a job token needs a dataset name".into()));
        }
        let text = format!(
            "{JOB_PREFIX}{}.{}",
            hex(dataset.as_bytes()),
            hex(&dataset_mac(self, dataset))
        );
        Token::parse(
            &text,
            &format!("the job token for dataset {dataset:?} (name too long)"),
        )
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

/// A server's side: refuses every call without the service's token or a
/// job token derived from it, in constant time over the secret bytes,
/// before the call's handler sees it; the handler reads the caller's
/// [`Scope`] ([`allow`]).
#[derive(Clone)]
pub struct Check {
    header: Arc<[u8]>,
    token: Token,
}

impl fmt::Debug for Check {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Check(..)")
    }
}

impl Check {
    pub fn new(token: &Token) -> Check {
        Check {
            header: token.header().as_bytes().into(),
            token: token.clone(),
        }
    }

    fn scope(&self, given: &[u8]) -> Option<Scope> {
        if bool::from(given.ct_eq(&self.header)) {
            return Some(Scope::Service);
        }
        let text = std::str::from_utf8(given).ok()?;
        let (dataset, mac) = text
            .strip_prefix(SCHEME)?
            .strip_prefix(JOB_PREFIX)?
            .split_once('.')?;
        let dataset = String::from_utf8(unhex(dataset)?).ok()?;
        let mac = unhex(mac)?;
        let want = dataset_mac(&self.token, &dataset);
        bool::from(mac.as_slice().ct_eq(&want)).then_some(Scope::Dataset(dataset))
    }
}

impl Interceptor for Check {
    fn call(&mut self, mut req: Request<()>) -> std::result::Result<Request<()>, Status> {
        let scope = req
            .metadata()
            .get(HEADER)
            .and_then(|v| self.scope(v.as_bytes()));
        match scope {
            Some(scope) => {
                req.extensions_mut().insert(scope);
                Ok(req)
            }
            None => Err(Status::unauthenticated(REFUSAL)),
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
    fn a_job_token_is_good_for_its_dataset_only_and_cannot_be_forged() {
        let service = Token::generate().unwrap();
        let mut check = Check::new(&service);
        let scope_of = |check: &mut Check, tok: &Token| {
            let r = Bearer::new(tok).call(Request::new(())).unwrap();
            check
                .call(r)
                .map(|r| r.extensions().get::<Scope>().cloned().unwrap())
        };
        assert_eq!(scope_of(&mut check, &service).unwrap(), Scope::Service);
        let job = service.for_dataset("my_data.make_dataset").unwrap();
        assert!(job.reveal().starts_with(JOB_PREFIX));
        assert!(!job.reveal().contains(service.reveal()));
        let scope = scope_of(&mut check, &job).unwrap();
        assert_eq!(scope, Scope::Dataset("my_data.make_dataset".into()));
        assert!(scope.allows(Some("my_data.make_dataset")));
        assert!(!scope.allows(Some("other.make")) && !scope.allows(None));
        assert!(Scope::Service.allows(None));
        // Another service's job token, a token whose dataset was swapped
        // under the same hash, and a cut hash are all refused.
        let foreign = Token::generate()
            .unwrap()
            .for_dataset("my_data.make_dataset")
            .unwrap();
        let (_, mac) = job.reveal().rsplit_once('.').unwrap();
        let swapped =
            Token::parse(&format!("{JOB_PREFIX}{}.{mac}", hex(b"other.make")), "t").unwrap();
        let cut = Token::parse(&job.reveal()[..job.reveal().len() - 2], "t").unwrap();
        for bad in [foreign, swapped, cut] {
            let s = scope_of(&mut check, &bad).unwrap_err();
            assert_eq!(s.code(), tonic::Code::Unauthenticated);
        }
        assert!(service.for_dataset("").is_err());
        assert!(service.for_dataset(&"d".repeat(300)).is_err());
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
