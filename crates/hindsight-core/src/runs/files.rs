//! Putting a checkpoint's files back into a working directory (what a
//! recording's training wrote there: `hindsight._run.files`), without ever
//! writing outside it.
//!
//! A checkpoint is data, and data can be crafted: an entry is refused, and
//! nothing is written, where it is empty or a dot, leaves the directory
//! (`..`, absolute), passes through or ends at a symbolic link, names a
//! protected path (the training script, the project home) or a Python
//! source file. The checks resolve every component relative to its parent
//! directory without following links (`openat` with `O_NOFOLLOW`), and the
//! writes do the same, so a link swapped in between is refused too.

use std::ffi::CString;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

use crate::error::{Error, Result};

fn refused(checkpoint: &str, rel: &str, why: &str) -> Error {
    Error::invalid(
        format!("checkpoint '{checkpoint}': file entry {rel:?}"),
        format!("{why}; nothing was restored"),
    )
}

/// The entry's components, each a plain name, or why not.
fn components(rel: &str) -> std::result::Result<Vec<&std::ffi::OsStr>, &'static str> {
    if rel.is_empty() || rel.contains('\0') {
        return Err("is empty or holds a NUL");
    }
    if rel.len() > libc::PATH_MAX as usize {
        return Err("is longer than a path can be");
    }
    let path = Path::new(rel);
    let mut out = Vec::new();
    for c in path.components() {
        match c {
            Component::Normal(name) if name.len() > 255 => {
                return Err("has a name longer than 255 bytes")
            }
            Component::Normal(name) => out.push(name),
            Component::CurDir => return Err("names the directory itself ('.')"),
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => {
                return Err("leaves the working directory")
            }
        }
    }
    if out.is_empty() || rel.ends_with('/') {
        return Err("names a directory, not a file");
    }
    Ok(out)
}

fn cstr(name: &std::ffi::OsStr) -> CString {
    // `components` refused NULs.
    CString::new(name.as_bytes()).unwrap_or_default()
}

/// Open `name` under `dir` as a directory, never through a link; `create`:
/// make it first where missing.
fn open_dir(
    dir: &OwnedFd,
    name: &std::ffi::OsStr,
    create: bool,
) -> std::io::Result<Option<OwnedFd>> {
    let c = cstr(name);
    let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: a valid directory fd and a NUL-terminated name.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags) };
    if fd >= 0 {
        // SAFETY: a fresh fd we own.
        return Ok(Some(unsafe { OwnedFd::from_raw_fd(fd) }));
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::ENOENT) {
        if !create {
            return Ok(None);
        }
        // SAFETY: as above.
        if unsafe { libc::mkdirat(dir.as_raw_fd(), c.as_ptr(), 0o777) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EEXIST) {
                return Err(e);
            }
        }
        return open_dir(dir, name, false);
    }
    Err(err)
}

/// What `name` under `dir` is, without following a link: None where absent.
fn kind_at(dir: &OwnedFd, name: &std::ffi::OsStr) -> std::io::Result<Option<libc::mode_t>> {
    let c = cstr(name);
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid fd, NUL-terminated name, a stat buffer of the right size.
    let rc = unsafe {
        libc::fstatat(
            dir.as_raw_fd(),
            c.as_ptr(),
            &mut st,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    };
    if rc == 0 {
        return Ok(Some(st.st_mode & libc::S_IFMT));
    }
    let err = std::io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::ENOENT) {
        Ok(None)
    } else {
        Err(err)
    }
}

fn open_root(root: &Path) -> Result<OwnedFd> {
    let c = CString::new(root.as_os_str().as_bytes())
        .map_err(|_| Error::invalid("working directory", "holds a NUL"))?;
    // SAFETY: a NUL-terminated path.
    let fd = unsafe {
        libc::open(
            c.as_ptr(),
            libc::O_RDONLY | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return Err(Error::io(root, std::io::Error::last_os_error()));
    }
    // SAFETY: a fresh fd we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Check one entry against the directory as it is now: every directory on
/// its way a real directory (or absent), the file itself absent or a
/// regular file.
fn check(root: &OwnedFd, parts: &[&std::ffi::OsStr]) -> std::result::Result<(), String> {
    let (file, dirs) = parts.split_last().ok_or("names nothing")?;
    let mut cur = root.try_clone().map_err(|e| e.to_string())?;
    for d in dirs {
        match kind_at(&cur, d).map_err(|e| e.to_string())? {
            None => return Ok(()), // created on the way: nothing below it yet
            Some(libc::S_IFDIR) => {}
            Some(libc::S_IFLNK) => return Err(format!("passes through the symbolic link {d:?}")),
            Some(_) => return Err(format!("passes through {d:?}, which is not a directory")),
        }
        cur = open_dir(&cur, d, false)
            .map_err(|e| e.to_string())?
            .ok_or("changed while being checked")?;
    }
    match kind_at(&cur, file).map_err(|e| e.to_string())? {
        None | Some(libc::S_IFREG) => Ok(()),
        Some(libc::S_IFLNK) => Err("is a symbolic link".into()),
        Some(_) => Err("is not a regular file".into()),
    }
}

/// Write `data` at `parts` under `root`: directories made as needed, never
/// through a link; the file written beside its place and renamed over it.
fn write(root: &OwnedFd, parts: &[&std::ffi::OsStr], data: &[u8]) -> std::io::Result<()> {
    let (file, dirs) = parts
        .split_last()
        .ok_or_else(|| std::io::Error::other("an entry naming nothing"))?;
    let mut cur = root.try_clone()?;
    for d in dirs {
        cur =
            open_dir(&cur, d, true)?.ok_or_else(|| std::io::Error::other("directory vanished"))?;
    }
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(file);
    tmp_name.push(".hindsight-restore");
    let tmp = cstr(&tmp_name);
    let flags = libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: valid fd, NUL-terminated name.
    let fd = unsafe { libc::openat(cur.as_raw_fd(), tmp.as_ptr(), flags, 0o666 as libc::c_uint) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh fd we own.
    let mut f = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    f.write_all(data)?;
    drop(f);
    let target = cstr(file);
    // SAFETY: valid fds and NUL-terminated names; renameat replaces a
    // regular file or a link itself, never what a link points to.
    if unsafe {
        libc::renameat(
            cur.as_raw_fd(),
            tmp.as_ptr(),
            cur.as_raw_fd(),
            target.as_ptr(),
        )
    } != 0
    {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Put `files` (entry relative to `root` -> bytes) back under `root`, or
/// refuse them all, naming the first bad entry. `protected`: paths no entry
/// may name or lie under (the script, the project home), absolute or
/// relative to `root`.
pub fn put_back(
    root: &Path,
    files: &[(String, Vec<u8>)],
    protected: &[PathBuf],
    checkpoint: &str,
) -> Result<()> {
    let root_fd = open_root(root)?;
    let canon = std::fs::canonicalize(root).map_err(|e| Error::io(root, e))?;
    let protected: Vec<PathBuf> = protected
        .iter()
        .map(|p| {
            let abs = if p.is_absolute() {
                p.clone()
            } else {
                canon.join(p)
            };
            std::fs::canonicalize(&abs).unwrap_or(abs)
        })
        .collect();
    let mut checked = Vec::with_capacity(files.len());
    for (rel, data) in files {
        let parts = components(rel).map_err(|why| refused(checkpoint, rel, why))?;
        let at: PathBuf = parts.iter().fold(canon.clone(), |p, c| p.join(c));
        if let Some(p) = protected.iter().find(|p| at.starts_with(p)) {
            return Err(refused(
                checkpoint,
                rel,
                &format!("would overwrite {}", p.display()),
            ));
        }
        if at.extension().is_some_and(|e| e == "py") {
            return Err(refused(checkpoint, rel, "would overwrite Python source"));
        }
        check(&root_fd, &parts).map_err(|why| refused(checkpoint, rel, &why))?;
        checked.push((rel, parts, data));
    }
    for (rel, parts, data) in checked {
        write(&root_fd, &parts, data).map_err(|e| match e.raw_os_error() {
            Some(libc::ELOOP) | Some(libc::ENOTDIR) => refused(
                checkpoint,
                rel,
                "passes through a symbolic link (swapped in while restoring)",
            ),
            _ => Error::io(root.join(rel), e),
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(list: &[(&str, &str)]) -> Vec<(String, Vec<u8>)> {
        list.iter()
            .map(|(k, v)| (k.to_string(), v.as_bytes().to_vec()))
            .collect()
    }

    #[test]
    fn files_go_back_under_the_directory_and_nowhere_else() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("work");
        let outside = tmp.path().join("OUTSIDE");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink("../OUTSIDE", root.join("link")).unwrap();
        std::fs::write(root.join("train.py"), "print(1)").unwrap();
        std::fs::create_dir(root.join(".hindsight")).unwrap();
        let protected = vec![PathBuf::from("train.py"), PathBuf::from(".hindsight")];

        put_back(
            &root,
            &entries(&[("out/metrics.json", "{}"), ("log.txt", "a")]),
            &protected,
            "ck",
        )
        .unwrap();
        assert_eq!(
            std::fs::read_to_string(root.join("out/metrics.json")).unwrap(),
            "{}"
        );
        assert_eq!(std::fs::read_to_string(root.join("log.txt")).unwrap(), "a");

        for (bad, says) in [
            ("link/evil.txt", "symbolic link"),
            ("link/newdir/x.txt", "symbolic link"),
            ("link", "symbolic link"),
            ("", "empty"),
            (".", "directory itself"),
            ("./", "directory itself"),
            ("a/../../x", "leaves"),
            ("/etc/passwd", "leaves"),
            ("train.py", "would overwrite"),
            (".hindsight/logs.db", "would overwrite"),
            ("pkg/model.py", "Python source"),
            ("out/", "names a directory"),
        ] {
            // A good entry first: nothing is written when any entry is bad.
            let list = entries(&[("first.txt", "x"), (bad, "evil")]);
            let err = put_back(&root, &list, &protected, "ck")
                .unwrap_err()
                .to_string();
            assert!(err.contains(says) && err.contains("ck"), "{bad:?}: {err}");
            assert!(!root.join("first.txt").exists(), "{bad:?}");
        }
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
        assert_eq!(
            std::fs::read_to_string(root.join("train.py")).unwrap(),
            "print(1)"
        );
    }

    #[test]
    fn a_link_in_place_of_the_file_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path();
        std::fs::write(root.join("target.txt"), "keep").unwrap();
        std::os::unix::fs::symlink("target.txt", root.join("out.txt")).unwrap();
        let err = put_back(root, &entries(&[("out.txt", "evil")]), &[], "ck").unwrap_err();
        assert!(err.to_string().contains("symbolic link"), "{err}");
        assert_eq!(
            std::fs::read_to_string(root.join("target.txt")).unwrap(),
            "keep"
        );
    }
}
