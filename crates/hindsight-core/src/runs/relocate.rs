//! A project that was moved or copied. A run row records absolute paths
//! (the script, the project root, the store, the working directory), so a
//! copied project read the original's checkpoints and a moved one found no
//! run at all. The rule, owned here:
//! - a run belongs to a script when it recorded that absolute path, or the
//!   same path relative to its project root as the script has now;
//! - read from a project whose root is not the recorded one, every recorded
//!   path under the recorded root is the same path under the current root
//!   (a copy reads its own copy of the store, a move finds its files);
//!   paths outside it (a shared store, `s3://`) stay as they are.

use std::path::{Path, PathBuf};

use crate::runs::db::RunRow;

impl RunRow {
    /// Whether this run recorded `script_abs`, a script whose project root
    /// is now `root_now` (see the module docs).
    pub fn is_of(&self, script_abs: &Path, root_now: &Path) -> bool {
        Path::new(&self.script_abs) == script_abs || root_now.join(&self.script) == script_abs
    }

    /// This run with its paths where they are now that its project root is
    /// `root_now` (unchanged when that is the recorded root).
    pub fn relocated(&self, root_now: &Path) -> RunRow {
        let from = Path::new(&self.project_root);
        if from == root_now || self.project_root.is_empty() {
            return self.clone();
        }
        let moved = |p: &str| -> String {
            match Path::new(p).strip_prefix(from) {
                Ok(rest) if Path::new(p).is_absolute() => {
                    join(root_now, rest).to_string_lossy().into_owned()
                }
                _ => p.to_owned(),
            }
        };
        let mut run = self.clone();
        run.script_abs = moved(&self.script_abs);
        run.store = self.store.as_deref().map(moved);
        run.project_root = root_now.to_string_lossy().into_owned();
        // The working directory and the script in the recorded command line.
        if let Ok(serde_json::Value::Object(mut v)) =
            serde_json::from_str::<serde_json::Value>(&self.versions_json)
        {
            if let Some(serde_json::Value::String(cwd)) = v.get("cwd") {
                let cwd = moved(cwd);
                v.insert("cwd".into(), cwd.into());
            }
            if let Some(serde_json::Value::Array(argv)) = v.get_mut("argv") {
                if let Some(serde_json::Value::String(first)) = argv.first_mut() {
                    *first = moved(first);
                }
            }
            run.versions_json = serde_json::Value::Object(v).to_string();
        }
        run
    }
}

fn join(root: &Path, rest: &Path) -> PathBuf {
    if rest.as_os_str().is_empty() {
        root.to_path_buf()
    } else {
        root.join(rest)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::runs::db::RunStatus;

    fn run() -> RunRow {
        RunRow {
            id: "r".into(),
            script: "src/train.py".into(),
            script_abs: "/home/a/proj/src/train.py".into(),
            project_root: "/home/a/proj".into(),
            source_hash: String::new(),
            git_commit: None,
            git_dirty: None,
            args_json: "{}".into(),
            status: RunStatus::Completed,
            started_ms: 0,
            ended_ms: None,
            host: String::new(),
            versions_json: r#"{"cwd":"/home/a/proj/src","argv":["/home/a/proj/src/train.py","--data","/data/x"],"torch":"2"}"#.into(),
            pid: 1,
            resume_key: None,
            store: Some("/home/a/proj/.hindsight/store".into()),
        }
    }

    #[test]
    fn a_run_is_of_its_script_where_it_was_and_where_the_project_is_now() {
        let r = run();
        assert!(r.is_of(
            Path::new("/home/a/proj/src/train.py"),
            Path::new("/home/a/proj")
        ));
        assert!(r.is_of(
            Path::new("/tmp/proj2/src/train.py"),
            Path::new("/tmp/proj2")
        ));
        // Another script of the same name elsewhere in the project is not it.
        assert!(!r.is_of(Path::new("/tmp/proj2/train.py"), Path::new("/tmp/proj2")));
        assert!(!r.is_of(Path::new("/tmp/other/src/train.py"), Path::new("/tmp")));
    }

    #[test]
    fn paths_under_the_recorded_root_follow_the_project_and_others_stay() {
        let r = run();
        assert_eq!(r.relocated(Path::new("/home/a/proj")), r);
        let m = r.relocated(Path::new("/tmp/proj2"));
        assert_eq!(m.script_abs, "/tmp/proj2/src/train.py");
        assert_eq!(m.store.as_deref(), Some("/tmp/proj2/.hindsight/store"));
        assert_eq!(m.project_root, "/tmp/proj2");
        let v: serde_json::Value = serde_json::from_str(&m.versions_json).unwrap();
        assert_eq!(v["cwd"], "/tmp/proj2/src");
        assert_eq!(v["argv"][0], "/tmp/proj2/src/train.py");
        assert_eq!(v["argv"][2], "/data/x", "arguments are the user's");
        assert_eq!(v["torch"], "2");
        // A store outside the project (shared, or remote) is where it was.
        for store in ["/scratch/store", "s3://bucket/p", "/home/a/proj2/store"] {
            let r = RunRow {
                store: Some(store.into()),
                ..run()
            };
            assert_eq!(
                r.relocated(Path::new("/tmp/proj2")).store.as_deref(),
                Some(store)
            );
        }
    }
}
