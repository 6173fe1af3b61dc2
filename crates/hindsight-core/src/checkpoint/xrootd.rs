//! XRootD storage, `root://host[:port]//path`: the grid's protocol, where
//! batch jobs in high-energy physics keep what must outlive the node (seed
//! 004). An [`ObjectStore`], so the generic layer in `object.rs` (layout,
//! commit order, leases, errors) is the one S3 and Azure use.
//!
//! **Mechanism: the XRootD client's own tools**, `xrdcp` and `xrdfs`, one
//! subprocess per operation. Why not the alternatives (numbers in
//! `docs/xrootd.md`):
//! * Every security protocol a site uses (GSI proxies, tokens, Kerberos, sss)
//!   works as it does for the user's own `xrdcp`: the client reads its usual
//!   variables (`X509_USER_PROXY`, `BEARER_TOKEN`, `XrdSecSSSKT`, ...). A
//!   protocol client written here would start with none of them.
//! * The server's HTTP interface (`davs://`) through object_store's HTTP
//!   store has no conditional create, which the gc lease needs.
//! * A subprocess costs about 20-30 ms of latency; checkpoints are written by
//!   the background writer in chunks of 4 MiB and more, so this is off the
//!   training thread and small beside the transfer itself.
//!
//! **Atomic puts.** A put uploads to a hidden name beside the object
//! (`.NAME.hs-upload-…`, with `--posc`, so the server removes it if the
//! upload dies) and renames it into place: the server's rename is atomic, so a
//! reader sees the old object or the complete new one. Listings skip hidden
//! uploads.
//!
//! **Conditional puts.** `PutMode::Create` is the server's exclusive open
//! (`xrdcp` without `--force`): of two racing creators exactly one wins. Its
//! bytes are written after the create, so a reader may briefly see a short
//! object; only lease objects are created this way, and their content is
//! informational (freshness is the modification time). `PutMode::Update` checks
//! the ETag (the server's file id, size and modification time) with a stat
//! right before the renaming put; an object last written by a plain put
//! (whose ETag would cost one more stat per chunk) is checked for existence
//! only. XRootD has no compare-and-swap, so a delete
//! that lands between the stat and the rename is undone by the rename: a
//! writer frozen past the lease timeout that wakes in that instant may commit
//! a manifest whose chunks a gc removed. Loading then fails, naming the
//! missing chunk; nothing is returned that was not verified.

use std::fmt;
use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};

use async_trait::async_trait;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use futures_util::stream::{self, BoxStream, StreamExt};
use object_store::path::Path as Key;
use object_store::{
    CopyMode, CopyOptions, GetOptions, GetResult, GetResultPayload, ListResult, MultipartUpload,
    ObjectMeta, ObjectStore, PutMode, PutMultipartOptions, PutOptions, PutPayload, PutResult,
    Result,
};

const STORE: &str = "XRootD";
/// A new root:// store's chunk size: each object costs a few client
/// processes, so fewer, larger objects.
pub const CHUNK_SIZE: usize = 32 << 20;
/// The ETag of a plain (overwriting) put, which skips the stat an ETag would
/// cost: an update against it checks only that the object still exists.
/// Writer leases are written this way; their names are unique to a writer, so
/// the only change to detect is a delete by a gc.
const EXISTS: &str = "xrootd:exists";
/// Marks an upload in flight (hidden from listings).
const UPLOAD_MARK: &str = ".hs-upload-";

/// A server, `root://host[:port]`; keys are absolute paths on it.
#[derive(Debug)]
pub struct Xrootd {
    server: String,
}

impl fmt::Display for Xrootd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "XRootD({})", self.server)
    }
}

/// What a failed tool said, sorted the way object_store's callers need.
fn failure(tool: &str, path: &str, status: Option<i32>, stderr: &[u8]) -> object_store::Error {
    let said = String::from_utf8_lossy(stderr).trim().to_string();
    let lower = said.to_ascii_lowercase();
    let source = format!("{tool} exited with {status:?}: {said}").into();
    let path = path.to_string();
    // Server error codes: 3011 kXR_NotFound, 3018 kXR_ItExists, 3010 kXR_NotAuthorized.
    if said.contains("[3011]") || lower.contains("no such file") {
        object_store::Error::NotFound { path, source }
    } else if said.contains("[3018]") || lower.contains("file exists") {
        object_store::Error::AlreadyExists { path, source }
    } else if said.contains("[3010]") || lower.contains("permission denied") {
        object_store::Error::PermissionDenied { path, source }
    } else if lower.contains("auth failed") {
        object_store::Error::Unauthenticated { path, source }
    } else {
        object_store::Error::Generic {
            store: STORE,
            source,
        }
    }
}

/// Run `tool args`, feeding `input` on stdin; its stdout on success.
fn run_tool(
    tool: &'static str,
    args: &[String],
    path: &str,
    input: Option<PutPayload>,
) -> Result<Vec<u8>> {
    let mut child = Command::new(tool)
        .args(args)
        // Listings and stats print times in the local zone: make it UTC.
        .env("TZ", "UTC")
        .stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| object_store::Error::Generic {
            store: STORE,
            source: format!(
                "cannot run {tool} ({e}): root:// stores need the XRootD client tools \
                 (Debian: apt-get install xrootd-client)"
            )
            .into(),
        })?;
    // Feed stdin from a thread while stdout and stderr are drained here, so
    // neither side can fill a pipe and stall the other.
    let feeder = match (input, child.stdin.take()) {
        (Some(payload), Some(mut stdin)) => Some(std::thread::spawn(move || {
            for part in &payload {
                stdin.write_all(part)?;
            }
            Ok::<(), std::io::Error>(())
        })),
        _ => None,
    };
    let mut stderr = Vec::new();
    let err_pipe = child.stderr.take();
    let err_reader = std::thread::spawn(move || {
        if let Some(mut e) = err_pipe {
            let _ = e.read_to_end(&mut stderr);
        }
        stderr
    });
    let mut out = Vec::new();
    if let Some(mut o) = child.stdout.take() {
        let _ = o.read_to_end(&mut out);
    }
    let status = child.wait().map_err(|e| object_store::Error::Generic {
        store: STORE,
        source: format!("waiting for {tool}: {e}").into(),
    })?;
    let stderr = err_reader.join().unwrap_or_default();
    let fed = feeder.map(|t| t.join());
    if !status.success() {
        return Err(failure(tool, path, status.code(), &stderr));
    }
    if let Some(r) = fed {
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                return Err(object_store::Error::Generic {
                    store: STORE,
                    source: format!("{tool} took only part of the upload to {path}: {e}").into(),
                })
            }
            Err(_) => {
                return Err(object_store::Error::Generic {
                    store: STORE,
                    source: format!("feeding {tool} for {path} panicked").into(),
                })
            }
        }
    }
    Ok(out)
}

/// `2026-11-30 10:41:03` (UTC, whole seconds) as a time.
fn parse_time(date: &str, time: &str) -> Option<DateTime<Utc>> {
    let civil: jiff::civil::DateTime = format!("{date}T{time}").parse().ok()?;
    let secs = civil
        .to_zoned(jiff::tz::TimeZone::UTC)
        .ok()?
        .timestamp()
        .as_second();
    DateTime::from_timestamp(secs, 0)
}

/// A key from an absolute path the server printed.
fn key_of(path: &str) -> Result<Key> {
    Ok(Key::parse(path.trim_start_matches('/'))?)
}

fn is_upload(path: &str) -> bool {
    path.rsplit('/')
        .next()
        .is_some_and(|name| name.starts_with('.') && name.contains(UPLOAD_MARK))
}

/// One line of `xrdfs ls -l`: (is a directory, meta).
fn parse_ls_line(line: &str) -> Option<(bool, ObjectMeta)> {
    let mut f = line.split_whitespace();
    let mode = f.next()?;
    let (_owner, _group) = (f.next()?, f.next()?);
    let size: u64 = f.next()?.parse().ok()?;
    let (date, time) = (f.next()?, f.next()?);
    let path: Vec<&str> = f.collect();
    let path = path.join(" ");
    let meta = ObjectMeta {
        location: key_of(&path).ok()?,
        last_modified: parse_time(date, time)?,
        size,
        e_tag: None,
        version: None,
    };
    Some((mode.starts_with('d'), meta))
}

fn not_supported(what: &str) -> object_store::Error {
    object_store::Error::NotSupported {
        source: format!("{STORE} stores do not support {what}").into(),
    }
}

impl Xrootd {
    /// The server `root://host[:port]` (`host` is what follows `root://`).
    pub fn new(host: &str) -> Xrootd {
        Xrootd {
            server: format!("root://{host}"),
        }
    }

    fn url(&self, key: &Key) -> String {
        format!("{}//{key}", self.server)
    }

    async fn tool(
        &self,
        tool: &'static str,
        args: Vec<String>,
        key: &Key,
        input: Option<PutPayload>,
    ) -> Result<Vec<u8>> {
        let path = self.url(key);
        tokio::task::spawn_blocking(move || run_tool(tool, &args, &path, input))
            .await
            .map_err(|e| object_store::Error::JoinError { source: e })?
    }

    async fn xrdfs(&self, args: &[&str], key: &Key) -> Result<Vec<u8>> {
        let mut all = vec![self.server.clone()];
        all.extend(args.iter().map(|a| a.to_string()));
        self.tool("xrdfs", all, key, None).await
    }

    /// `xrdfs stat`: size, modification time and an ETag (the server's file
    /// id with size and time: a rename onto the name gives a new id).
    async fn stat(&self, key: &Key) -> Result<ObjectMeta> {
        let out = self.xrdfs(&["stat", &format!("/{key}")], key).await?;
        let text = String::from_utf8_lossy(&out);
        let field = |name: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_string()))
        };
        let bad = || object_store::Error::Generic {
            store: STORE,
            source: format!(
                "unexpected `xrdfs stat` output for {}: {text}",
                self.url(key)
            )
            .into(),
        };
        let id = field("Id:").ok_or_else(bad)?;
        let size: u64 = field("Size:")
            .and_then(|s| s.parse().ok())
            .ok_or_else(bad)?;
        let mtime = field("MTime:").ok_or_else(bad)?;
        let (date, time) = mtime.split_once(' ').ok_or_else(bad)?;
        if field("Flags:").is_some_and(|f| f.contains("IsDir")) {
            return Err(object_store::Error::NotFound {
                path: self.url(key),
                source: "a directory, not an object".into(),
            });
        }
        Ok(ObjectMeta {
            location: key.clone(),
            last_modified: parse_time(date, time.trim()).ok_or_else(bad)?,
            size,
            e_tag: Some(format!("{id}-{size}-{mtime}")),
            version: None,
        })
    }

    /// Upload `payload` to `key`, `exclusive`ly (fails if it exists) or not.
    async fn xrdcp_up(&self, key: &Key, payload: PutPayload, exclusive: bool) -> Result<()> {
        let mut args = vec!["--silent".to_string(), "--posc".to_string()];
        if !exclusive {
            args.push("--force".to_string());
        }
        args.extend(["-".to_string(), self.url(key)]);
        self.tool("xrdcp", args, key, Some(payload))
            .await
            .map(|_| ())
    }

    /// Upload under a hidden name beside `key`, then rename it into place.
    async fn put_atomic(&self, key: &Key, payload: PutPayload) -> Result<()> {
        static N: AtomicU64 = AtomicU64::new(0);
        let name = key.filename().unwrap_or("object");
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let hidden = format!(
            ".{name}{UPLOAD_MARK}{}-{nanos}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let parts: Vec<_> = key.parts().collect();
        let parent: Key = parts[..parts.len().saturating_sub(1)]
            .iter()
            .cloned()
            .collect();
        let tmp = parent.join(hidden.as_str());
        self.xrdcp_up(&tmp, payload, true).await?;
        let renamed = self
            .xrdfs(&["mv", &format!("/{tmp}"), &format!("/{key}")], key)
            .await;
        if renamed.is_err() {
            let _ = self.xrdfs(&["rm", &format!("/{tmp}")], &tmp).await;
        }
        renamed.map(|_| ())
    }

    async fn ls(&self, dir: &Key, recursive: bool) -> Result<Vec<(bool, ObjectMeta)>> {
        let path = format!("/{dir}");
        let args: &[&str] = if recursive {
            &["ls", "-l", "-R", &path]
        } else {
            &["ls", "-l", &path]
        };
        let out = match self.xrdfs(args, dir).await {
            Ok(out) => out,
            Err(object_store::Error::NotFound { .. }) => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        Ok(String::from_utf8_lossy(&out)
            .lines()
            .filter_map(parse_ls_line)
            .filter(|(_, m)| !is_upload(m.location.as_ref()))
            .collect())
    }
}

#[async_trait]
impl ObjectStore for Xrootd {
    async fn put_opts(
        &self,
        location: &Key,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        match &opts.mode {
            PutMode::Overwrite => {
                self.put_atomic(location, payload).await?;
                return Ok(PutResult {
                    e_tag: Some(EXISTS.to_string()),
                    version: None,
                    extensions: Default::default(),
                });
            }
            PutMode::Create => self.xrdcp_up(location, payload, true).await?,
            PutMode::Update(v) => {
                let now = match self.stat(location).await {
                    Ok(m) => m,
                    Err(object_store::Error::NotFound { path, source }) => {
                        return Err(object_store::Error::Precondition { path, source })
                    }
                    Err(e) => return Err(e),
                };
                if v.e_tag.as_deref().is_some_and(|e| e != EXISTS) && now.e_tag != v.e_tag {
                    return Err(object_store::Error::Precondition {
                        path: self.url(location),
                        source: format!("ETag {:?}, expected {:?}", now.e_tag, v.e_tag).into(),
                    });
                }
                self.put_atomic(location, payload).await?
            }
        }
        let meta = self.stat(location).await?;
        Ok(PutResult {
            e_tag: meta.e_tag,
            version: None,
            extensions: Default::default(),
        })
    }

    async fn put_multipart_opts(
        &self,
        _location: &Key,
        _opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        Err(not_supported("multipart uploads"))
    }

    async fn get_opts(&self, location: &Key, options: GetOptions) -> Result<GetResult> {
        if options.range.is_some()
            || options.if_match.is_some()
            || options.if_none_match.is_some()
            || options.if_modified_since.is_some()
            || options.if_unmodified_since.is_some()
            || options.version.is_some()
        {
            return Err(not_supported("ranged or conditional reads"));
        }
        let meta = self.stat(location).await?;
        let bytes = if options.head {
            Bytes::new()
        } else {
            let args = vec!["--silent".to_string(), self.url(location), "-".to_string()];
            Bytes::from(self.tool("xrdcp", args, location, None).await?)
        };
        let range = 0..if options.head {
            meta.size
        } else {
            bytes.len() as u64
        };
        let payload = if options.head {
            stream::empty().boxed()
        } else {
            stream::once(async move { Ok(bytes) }).boxed()
        };
        Ok(GetResult {
            payload: GetResultPayload::Stream(payload),
            meta: ObjectMeta {
                size: range.end,
                ..meta
            },
            range,
            attributes: Default::default(),
            extensions: Default::default(),
        })
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Key>>,
    ) -> BoxStream<'static, Result<Key>> {
        let server = self.server.clone();
        locations
            .then(move |key| {
                let me = Xrootd {
                    server: server.clone(),
                };
                async move {
                    let key = key?;
                    match me.xrdfs(&["rm", &format!("/{key}")], &key).await {
                        Ok(_) | Err(object_store::Error::NotFound { .. }) => Ok(key),
                        Err(e) => Err(e),
                    }
                }
            })
            .boxed()
    }

    fn list(&self, prefix: Option<&Key>) -> BoxStream<'static, Result<ObjectMeta>> {
        let me = Xrootd {
            server: self.server.clone(),
        };
        let dir = prefix.cloned().unwrap_or_default();
        stream::once(async move { me.ls(&dir, true).await })
            .map(|r| match r {
                Ok(entries) => stream::iter(
                    entries
                        .into_iter()
                        .filter(|(is_dir, _)| !is_dir)
                        .map(|(_, m)| Ok(m))
                        .collect::<Vec<_>>(),
                )
                .boxed(),
                Err(e) => stream::once(async move { Err(e) }).boxed(),
            })
            .flatten()
            .boxed()
    }

    async fn list_with_delimiter(&self, prefix: Option<&Key>) -> Result<ListResult> {
        let dir = prefix.cloned().unwrap_or_default();
        let mut out = ListResult {
            common_prefixes: Vec::new(),
            objects: Vec::new(),
            extensions: Default::default(),
        };
        for (is_dir, meta) in self.ls(&dir, false).await? {
            if is_dir {
                out.common_prefixes.push(meta.location);
            } else {
                out.objects.push(meta);
            }
        }
        Ok(out)
    }

    async fn copy_opts(&self, from: &Key, to: &Key, options: CopyOptions) -> Result<()> {
        let args = vec!["--silent".to_string(), self.url(from), "-".to_string()];
        let bytes = self.tool("xrdcp", args, from, None).await?;
        let payload = PutPayload::from(bytes);
        match options.mode {
            CopyMode::Overwrite => self.put_atomic(to, payload).await,
            CopyMode::Create => self.xrdcp_up(to, payload, true).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listing_lines_parse_and_uploads_are_hidden() {
        let (dir, m) =
            parse_ls_line("-rw-r--r-- xrootd xrootd    4 2026-11-30 10:41:03 /n/chunks/ab/cd")
                .unwrap();
        assert!(!dir);
        assert_eq!(m.location.as_ref(), "n/chunks/ab/cd");
        assert_eq!(m.size, 4);
        assert_eq!(m.last_modified.timestamp(), 1_796_035_263);
        let (dir, _) =
            parse_ls_line("drwxr-xr-x xrootd xrootd 4096 2026-11-30 10:41:03 /n/d1").unwrap();
        assert!(dir);
        assert!(parse_ls_line("[127.0.0.1:1094] / > ls").is_none());
        assert!(is_upload("n/chunks/ab/.cd.hs-upload-1-2-3"));
        assert!(!is_upload("n/chunks/ab/cd"));
    }

    #[test]
    fn tool_failures_are_sorted_by_what_the_server_said() {
        let e = failure("xrdfs", "root://h//a", Some(54), b"[ERROR] Server responded with an error: [3011] Unable to locate /a; no such file or directory");
        assert!(matches!(e, object_store::Error::NotFound { .. }), "{e}");
        let e = failure(
            "xrdcp",
            "root://h//a",
            Some(50),
            b"Run: [ERROR] Invalid operation: file exists",
        );
        assert!(
            matches!(e, object_store::Error::AlreadyExists { .. }),
            "{e}"
        );
        let e = failure(
            "xrdfs",
            "root://h//a",
            Some(52),
            b"[FATAL] Auth failed: No protocols left to try",
        );
        assert!(
            matches!(e, object_store::Error::Unauthenticated { .. }),
            "{e}"
        );
        let e = failure(
            "xrdfs",
            "root://h//a",
            Some(51),
            b"[FATAL] Connection error",
        );
        assert!(e.to_string().contains("Connection error"), "{e}");
    }
}
