//! The project home: the directory holding a project's run database
//! (`logs.db`) and its checkpoint store (`store/`).
//!
//! `$HINDSIGHT_HOME`, when set and not empty, is the home itself (relative:
//! to the current directory, made absolute, so that the project root, and the
//! resume key taken relative to it, do not depend on where the job runs: an
//! HTCondor job's `HINDSIGHT_HOME=.hindsight` resumes on another node's
//! scratch directory). Otherwise
//! the home is `.hindsight` in the nearest enclosing git work tree (the
//! first directory, walking up from the start, that contains a `.git`
//! directory or file), or in the start directory when there is none. The
//! Python package asks this module, starting from the training script's
//! directory; the CLI starts from the current directory.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// The environment variable naming the project home.
pub const HOME_ENV: &str = crate::settings::HOME.name;

/// Name of the home directory inside a project.
pub const HOME_DIR: &str = ".hindsight";

/// The run database inside a home.
pub const DB_FILE: &str = "logs.db";

/// The checkpoint store inside a home.
pub const STORE_DIR: &str = "store";

/// The project home for a program started in `start` (see the module docs).
pub fn project_home(start: &Path) -> PathBuf {
    resolve_home(std::env::var_os(HOME_ENV), start)
}

/// [`project_home`] with the value of `$HINDSIGHT_HOME` given explicitly.
///
/// `start` is made absolute and its symbolic links resolved first (as
/// Python's `Path.resolve()` does), so the walk up follows the real
/// directory tree. The value of `$HINDSIGHT_HOME` is used as given, made
/// absolute against the current directory where it is relative.
pub fn resolve_home(env: Option<OsString>, start: &Path) -> PathBuf {
    locate_home(env, start).0
}

/// Which part of the rule chose a project home.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HomeSource {
    /// `$HINDSIGHT_HOME` names it.
    Env,
    /// `.hindsight` in this enclosing git work tree.
    GitRoot(PathBuf),
    /// `.hindsight` in the start directory: no git work tree encloses it.
    Start(PathBuf),
}

impl std::fmt::Display for HomeSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HomeSource::Env => write!(f, "${HOME_ENV} names it"),
            HomeSource::GitRoot(d) => write!(f, "{HOME_DIR} in the git work tree {}", d.display()),
            HomeSource::Start(d) => write!(
                f,
                "{HOME_DIR} in {}, which no git work tree encloses",
                d.display()
            ),
        }
    }
}

/// The project home for `start` and why it is that one (see the module docs).
pub fn locate_home(env: Option<OsString>, start: &Path) -> (PathBuf, HomeSource) {
    if let Some(home) = env.filter(|h| !h.is_empty()) {
        let home = PathBuf::from(home);
        let home = std::path::absolute(&home).unwrap_or(home);
        return (home, HomeSource::Env);
    }
    let start = start
        .canonicalize()
        .or_else(|_| std::path::absolute(start))
        .unwrap_or_else(|_| start.to_path_buf());
    match start.ancestors().find(|dir| dir.join(".git").exists()) {
        Some(root) => (root.join(HOME_DIR), HomeSource::GitRoot(root.to_path_buf())),
        None => (start.join(HOME_DIR), HomeSource::Start(start.clone())),
    }
}

/// Refuse a home that exists and is not a directory (a file named
/// `.hindsight`), naming it: SQLite's own message ("unable to open database
/// file") and "no project" both hid what was wrong.
pub fn check_home(home: &Path) -> crate::Result<()> {
    match std::fs::metadata(home) {
        Ok(m) if !m.is_dir() => Err(crate::Error::invalid(
            "project home",
            format!(
                "{} is a file, not a directory: move it aside (or set ${HOME_ENV} to a directory)",
                home.display()
            ),
        )),
        _ => Ok(()),
    }
}

/// The run database of a home.
pub fn db_path(home: &Path) -> PathBuf {
    home.join(DB_FILE)
}

/// The checkpoint store of a home.
pub fn store_path(home: &Path) -> PathBuf {
    home.join(STORE_DIR)
}

#[cfg(test)]
mod tests {
    // A panic is a test failure.
    #![allow(clippy::unwrap_used)]

    use super::*;
    use std::fs;

    #[test]
    fn env_value_is_the_home_itself() {
        let start = Path::new("/somewhere");
        assert_eq!(
            resolve_home(Some("/data/proj-home".into()), start),
            PathBuf::from("/data/proj-home")
        );
        // A relative value is taken from the current directory, made
        // absolute: the project root (its parent) is then where the job
        // runs, wherever that is.
        assert_eq!(
            resolve_home(Some("rel/home".into()), start),
            std::env::current_dir().unwrap().join("rel/home")
        );
    }

    #[test]
    fn empty_env_value_counts_as_unset() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap().join("repo");
        fs::create_dir_all(root.join(".git")).unwrap();
        assert_eq!(
            resolve_home(Some(OsString::new()), &root),
            root.join(".hindsight")
        );
    }

    #[test]
    fn nearest_git_work_tree_wins() {
        let dir = tempfile::tempdir().unwrap();
        let outer = dir.path().canonicalize().unwrap().join("outer");
        let inner = outer.join("vendor/inner");
        let deep = inner.join("src/models");
        fs::create_dir_all(&deep).unwrap();
        fs::create_dir_all(outer.join(".git")).unwrap();
        assert_eq!(resolve_home(None, &deep), outer.join(".hindsight"));
        assert_eq!(resolve_home(None, &outer), outer.join(".hindsight"));
        // A `.git` file (worktree, submodule) marks a work tree too.
        fs::write(inner.join(".git"), "gitdir: ../../.git/modules/inner\n").unwrap();
        assert_eq!(resolve_home(None, &deep), inner.join(".hindsight"));
    }

    #[test]
    fn without_git_the_start_directory_is_the_project() {
        let dir = tempfile::tempdir().unwrap();
        let start = dir.path().canonicalize().unwrap().join("a/b");
        fs::create_dir_all(&start).unwrap();
        if start.ancestors().any(|d| d.join(".git").exists()) {
            eprintln!("skipped: the temporary directory is inside a git work tree");
            return;
        }
        assert_eq!(resolve_home(None, &start), start.join(".hindsight"));
    }

    #[cfg(unix)]
    #[test]
    fn symbolic_links_are_resolved_first() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().canonicalize().unwrap();
        let repo = real.join("repo");
        fs::create_dir_all(repo.join(".git")).unwrap();
        fs::create_dir_all(repo.join("src")).unwrap();
        // elsewhere/link -> repo/src: the walk up goes through repo.
        fs::create_dir(real.join("elsewhere")).unwrap();
        std::os::unix::fs::symlink(repo.join("src"), real.join("elsewhere/link")).unwrap();
        assert_eq!(
            resolve_home(None, &real.join("elsewhere/link")),
            repo.join(".hindsight")
        );
        // A start that does not exist is still made absolute.
        let missing = real.join("elsewhere/missing");
        if !missing.ancestors().any(|d| d.join(".git").exists()) {
            assert_eq!(resolve_home(None, &missing), missing.join(".hindsight"));
        }
    }

    #[test]
    fn relative_start_is_made_absolute() {
        let home = resolve_home(None, Path::new("."));
        assert!(home.is_absolute(), "{}", home.display());
        assert!(home.ends_with(".hindsight"), "{}", home.display());
    }

    #[test]
    fn files_of_a_home() {
        let home = Path::new("/p/.hindsight");
        assert_eq!(db_path(home), PathBuf::from("/p/.hindsight/logs.db"));
        assert_eq!(store_path(home), PathBuf::from("/p/.hindsight/store"));
    }
}
