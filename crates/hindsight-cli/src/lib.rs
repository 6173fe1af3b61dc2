//! The `hindsight` command: housekeeping for checkpoint stores (list, show,
//! verify, remove, gc, du) and queries over the runs a project recorded
//! (runs, logs, show RUN).
//!
//! [`run`] is the whole program. It writes only to the writers it is given
//! and never exits the process, so the Python package can call it too.
//!
//! Where things are: a project's run database is `<home>/logs.db` and its
//! checkpoint store `<home>/store`, with the home found by
//! [`home::project_home`] from the current directory (or given by `--home`).
//!
//! Exit codes: 0 success, 1 an engine error (not found, corrupt, I/O), a
//! missing project or problems found by `verify`, 2 a usage error.

use std::collections::HashSet;
use std::ffi::OsString;
use std::fmt::{self, Write as _};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::builder::TypedValueParser as _;
use clap::{Parser, Subcommand};
use hindsight_core::runs::db::Repair;
use hindsight_core::runs::supervise;
use hindsight_core::{LogDb, Manifest, Node, Store};
use serde_json::json;

/// Append one line to a `String` buffer (writing to a `String` cannot fail).
macro_rules! outln {
    ($buf:expr) => {
        $buf.push('\n')
    };
    ($buf:expr, $($arg:tt)*) => {{
        let _ = writeln!($buf, $($arg)*);
    }};
}

pub use hindsight_core::runs::project as home;
pub mod pycmds;
mod runcmds;

use runcmds::PhaseFilter;

/// Exit code for success.
pub const EXIT_OK: i32 = 0;
/// Exit code for an engine error or problems found by `verify`.
pub const EXIT_FAILURE: i32 = 1;
/// Exit code for a usage error.
pub const EXIT_USAGE: i32 = 2;

#[derive(Debug, Parser)]
#[command(
    name = "hindsight",
    bin_name = "hindsight",
    version,
    about = "Query hindsight runs and their logs; look after checkpoint stores",
    arg_required_else_help = true
)]
struct Cli {
    /// The store: a directory, or s3://bucket/prefix (AWS_* variables)
    #[arg(
        short = 's',
        long = "store",
        value_name = "PATH",
        env = hindsight_core::settings::STORE.name,
        global = true,
        // Accept an empty value (`HINDSIGHT_STORE=`) and treat it as unset.
        value_parser = clap::builder::OsStringValueParser::new().map(PathBuf::from)
    )]
    store: Option<PathBuf>,

    /// The project home, holding logs.db and store/
    ///
    /// Default: $HINDSIGHT_HOME if set, else .hindsight in the nearest
    /// enclosing git work tree, else .hindsight in the current directory.
    #[arg(
        long = "home",
        value_name = "PATH",
        global = true,
        value_parser = clap::builder::OsStringValueParser::new().map(PathBuf::from)
    )]
    home: Option<PathBuf>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List the checkpoints in a store
    Ls {
        /// The store directory (overrides --store)
        #[arg(value_name = "STORE")]
        store_dir: Option<PathBuf>,
        /// Print a JSON array instead of a table
        #[arg(long)]
        json: bool,
    },
    /// List the recorded runs, newest first
    Runs {
        /// Show at most N runs
        #[arg(short = 'n', long, value_name = "N")]
        limit: Option<usize>,
        /// Print a JSON array instead of a table
        #[arg(long)]
        json: bool,
    },
    /// Show logged values, one row per loop iteration
    Logs {
        /// The run (default: the latest; a first argument that is not a run id is a NAME)
        #[arg(value_name = "RUN")]
        run: Option<String>,
        /// The logged values to show (default: all)
        #[arg(value_name = "NAME")]
        names: Vec<String>,
        /// Which phase's values to show
        #[arg(long, value_enum, default_value_t = PhaseFilter::All)]
        phase: PhaseFilter,
        /// Print a JSON array instead of a table
        #[arg(long)]
        json: bool,
    },
    /// Show a run, or the contents of one checkpoint
    Show {
        /// A run id, or a checkpoint name
        name: String,
    },
    /// Write a checkpoint's tensors to one safetensors file (pieces saved by several ranks assembled)
    Consolidate {
        /// The checkpoint
        name: String,
        /// The .safetensors file to write
        out: PathBuf,
        /// Only the sub-tree at this key path ("state/model")
        #[arg(long, value_name = "KEY/PATH")]
        path: Option<String>,
    },
    /// Read back and check every byte of the checkpoints
    Verify {
        /// The store directory (overrides --store)
        #[arg(value_name = "STORE")]
        store_dir: Option<PathBuf>,
        /// Verify only this checkpoint (repeatable; default: all)
        #[arg(short = 'n', long = "name", value_name = "NAME")]
        names: Vec<String>,
    },
    /// Remove checkpoints (run `hindsight gc` afterwards to reclaim space)
    Rm {
        /// The checkpoint names
        #[arg(value_name = "NAME", required_unless_present = "runs")]
        names: Vec<String>,
        /// Delete these recorded runs: their checkpoints, logs and iterations
        /// (`--run A B`, or repeated; checkpoint names go before `--run`)
        #[arg(long = "run", value_name = "RUN", num_args = 1..)]
        runs: Vec<String>,
    },
    /// Delete chunks no checkpoint references and stale staging files
    Gc {
        /// The store directory (overrides --store)
        #[arg(value_name = "STORE")]
        store_dir: Option<PathBuf>,
    },
    /// Show how much space the store uses and how well it deduplicates
    Du {
        /// The store directory (overrides --store)
        #[arg(value_name = "STORE")]
        store_dir: Option<PathBuf>,
        /// Print a JSON object instead of text
        #[arg(long)]
        json: bool,
    },
    /// Show the project home this directory uses, and why: its run database and store
    Where,
    /// List the HINDSIGHT_* environment variables: value here, default, what each does
    Settings {
        /// Also those hindsight sets for the processes it starts
        #[arg(long)]
        all: bool,
    },
    /// Check the project's run database (logs.db) and, if it is damaged,
    /// rebuild it from every row still readable; the damaged file is kept
    /// beside it. Run it while no recording or replay is running
    Repair,
    /// Run a training command; restart it after a crash or hang (it resumes
    /// from its last checkpoint); pass signals through to it
    Run {
        /// Restarts after a crash or hang before giving up
        #[arg(long, default_value_t = 3)]
        max_restarts: u32,
        /// Seconds without a step boundary of `hs.loop` (counted from the
        /// first one) that mean hung (default: no hang detection)
        #[arg(long, value_name = "SECONDS")]
        hang_timeout: Option<f64>,
        /// Seconds to wait before the first restart (doubles per quick failure)
        #[arg(long, value_name = "SECONDS", default_value_t = 1.0)]
        backoff: f64,
        /// The training command, after `--`
        #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
        command: Vec<std::ffi::OsString>,
    },
    /// Re-run a recorded run with new log statements: partial (restoring
    /// checkpoints) and parallel (-j workers)
    Replay(pycmds::ReplayArgs),
    /// Draw logged series of runs into one image (one panel per name, one line per run)
    Plot(pycmds::PlotArgs),
    /// Write logged series of runs as TensorBoard event files, one directory per run
    Export(pycmds::ExportArgs),
    /// Run a training script (the same as `python SCRIPT ARGS`); with
    /// --explain, only say what its checkpoints would hold and why
    Record(pycmds::RecordArgs),
    /// The input service: its dispatcher, a dataset's worker, a job token
    #[command(subcommand)]
    Data(pycmds::DataCommand),
}

/// Why a command stopped.
#[derive(Debug)]
enum Failure {
    Usage(String),
    /// Not an engine error, but a failure all the same (exit code 1).
    Failed(String),
    Engine(hindsight_core::Error),
}

impl Failure {
    fn exit_code(&self) -> i32 {
        match self {
            Failure::Usage(_) => EXIT_USAGE,
            Failure::Failed(_) | Failure::Engine(_) => EXIT_FAILURE,
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Usage(msg) | Failure::Failed(msg) => f.write_str(msg),
            Failure::Engine(e) => e.fmt(f),
        }
    }
}

impl From<hindsight_core::Error> for Failure {
    fn from(e: hindsight_core::Error) -> Self {
        Failure::Engine(e)
    }
}

/// What [`dispatch`] did with a command line.
#[derive(Debug)]
pub enum Dispatch {
    /// The command ran here (or its help or usage error was written): its exit code.
    Done(i32),
    /// A command the Python package carries out, parsed.
    Python(Box<pycmds::PythonCall>),
}

/// Run the `hindsight` command with `args` (the first item is the program
/// name). Normal output goes to `out`, errors to `err`; returns the exit code.
/// The Python package's commands are refused, naming the package.
pub fn run<I, T>(args: I, out: &mut dyn Write, err: &mut dyn Write) -> i32
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    match dispatch(args, out, err) {
        Dispatch::Done(code) => code,
        Dispatch::Python(call) => {
            let _ = writeln!(err, "error: {}", python_only(call.command.name()));
            EXIT_USAGE
        }
    }
}

/// Parse `args` by the one grammar of `hindsight` and run the command, or
/// hand a Python command back parsed (its help and usage errors are
/// written here like every other command's).
pub fn dispatch<I, T>(args: I, out: &mut dyn Write, err: &mut dyn Write) -> Dispatch
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    use clap::{CommandFactory as _, FromArgMatches as _};
    let parsed = Cli::command()
        .try_get_matches_from(args)
        .and_then(|m| Cli::from_arg_matches(&m).map(|cli| (cli, m)));
    let (cli, matches) = match parsed {
        Ok(parsed) => parsed,
        Err(e) => {
            let text = e.to_string();
            let dest: &mut dyn Write = if e.use_stderr() { err } else { out };
            let _ = dest.write_all(text.as_bytes());
            let _ = dest.flush();
            return Dispatch::Done(e.exit_code());
        }
    };
    let python = match &cli.command {
        Command::Replay(a) => Some(pycmds::PythonCommand::Replay(a.clone())),
        Command::Plot(a) => Some(pycmds::PythonCommand::Plot(a.clone())),
        Command::Export(a) => Some(pycmds::PythonCommand::Export(a.clone())),
        Command::Record(a) => Some(pycmds::PythonCommand::Record(a.clone())),
        Command::Data(a) => Some(pycmds::PythonCommand::Data(a.clone())),
        _ => None,
    };
    if let Some(command) = python {
        // A global option given after the subcommand is the subcommand's match.
        let given = |m: &clap::ArgMatches| {
            m.value_source("store") == Some(clap::parser::ValueSource::CommandLine)
        };
        let store_given = given(&matches) || matches.subcommand().is_some_and(|(_, m)| given(m));
        return Dispatch::Python(Box::new(pycmds::PythonCall {
            command,
            home: cli.home,
            store_given,
        }));
    }

    // Output is collected first and written at the end, so a closed pipe
    // (`hindsight ls | head`) cannot change the outcome of a command.
    let mut buf = String::new();
    let mut code = match execute(cli, &mut buf, err) {
        Ok(code) => code,
        Err(failure) => {
            let _ = writeln!(err, "error: {failure}");
            failure.exit_code()
        }
    };
    if let Err(e) = out.write_all(buf.as_bytes()).and_then(|()| out.flush()) {
        if e.kind() != io::ErrorKind::BrokenPipe {
            let _ = writeln!(err, "error: cannot write output: {e}");
            code = code.max(EXIT_FAILURE);
        }
    }
    let _ = err.flush();
    Dispatch::Done(code)
}

fn execute(cli: Cli, out: &mut String, err: &mut dyn Write) -> Result<i32, Failure> {
    let places = Places {
        store: cli.store,
        home: cli.home,
    };
    match cli.command {
        Command::Ls { store_dir, json } => cmd_ls(&places.open_store(store_dir)?, json, out, err),
        Command::Show { name } => cmd_show_any(&places, &name, out, err),
        Command::Consolidate {
            name,
            out: file,
            path,
        } => cmd_consolidate(places.open_store(None)?, &name, &file, path.as_deref(), out),
        Command::Verify { store_dir, names } => {
            // The project's own store: its run database is checked with it.
            let db = (store_dir.is_none()
                && names.is_empty()
                && non_empty(places.store.clone()).is_none())
            .then(|| home::db_path(&places.home()))
            .filter(|p| p.is_file());
            let code = cmd_verify(&places.open_store(store_dir)?, names, out)?;
            Ok(match db {
                Some(path) => code.max(cmd_verify_db(&path, out)),
                None => code,
            })
        }
        Command::Rm { names, runs } => {
            let mut code = EXIT_OK;
            if !runs.is_empty() {
                code = cmd_rm_runs(&places, &runs, out, err)?;
            }
            if !names.is_empty() {
                code = code.max(cmd_rm(
                    &places.open_store(None)?,
                    &places.home(),
                    &names,
                    out,
                    err,
                ));
            }
            Ok(code)
        }
        Command::Gc { store_dir } => cmd_gc(&places.open_store(store_dir)?, out, err),
        Command::Du { store_dir, json } => cmd_du(&places.open_store(store_dir)?, json, out, err),
        Command::Runs { limit, json } => runcmds::cmd_runs(&places.open_db()?, limit, json, out),
        Command::Where => cmd_where(&places, out),
        Command::Settings { all } => cmd_settings(all, out),
        Command::Repair => cmd_repair(&places, out),
        Command::Logs {
            run,
            names,
            phase,
            json,
        } => runcmds::cmd_logs(&places.open_db()?, run, names, phase, json, out),
        Command::Run {
            max_restarts,
            hang_timeout,
            backoff,
            command,
        } => {
            // At most a year: any longer is a typo, and a deadline that far
            // cannot be computed on every platform.
            const MAX_SECONDS: f64 = 365.0 * 24.0 * 3600.0;
            let seconds = |arg: &str, v: f64| {
                if (0.0..=MAX_SECONDS).contains(&v) {
                    Ok(Duration::from_secs_f64(v))
                } else {
                    Err(Failure::Usage(format!(
                        "--{arg} {v}: give a number of seconds from 0 to {MAX_SECONDS} (a year)"
                    )))
                }
            };
            let policy = supervise::Policy {
                max_restarts,
                hang_timeout: hang_timeout
                    .map(|v| seconds("hang-timeout", v))
                    .transpose()?,
                backoff: seconds("backoff", backoff)?,
                ..Default::default()
            };
            // Live messages: the command's own output is interleaved with them.
            Ok(supervise::supervise(&command, &policy, &mut io::stderr())?)
        }
        Command::Replay(_)
        | Command::Plot(_)
        | Command::Export(_)
        | Command::Record(_)
        | Command::Data(_) => {
            unreachable!("dispatch hands Python's commands to the Python package")
        }
    }
}

/// Where the commands find the store and the run database.
#[derive(Debug)]
struct Places {
    /// `--store` or `$HINDSIGHT_STORE`.
    store: Option<PathBuf>,
    /// `--home`.
    home: Option<PathBuf>,
}

fn non_empty(p: Option<PathBuf>) -> Option<PathBuf> {
    p.filter(|p| !p.as_os_str().is_empty())
}

impl Places {
    /// The project home: `--home`, else found from the current directory.
    fn home(&self) -> PathBuf {
        non_empty(self.home.clone()).unwrap_or_else(|| {
            let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
            home::project_home(&cwd)
        })
    }

    /// Open an existing store (the CLI never creates one): the positional
    /// STORE, else `--store`/`$HINDSIGHT_STORE`, else the project's store if
    /// it exists.
    fn open_store(&self, positional: Option<PathBuf>) -> Result<Store, Failure> {
        let path = match non_empty(positional).or_else(|| non_empty(self.store.clone())) {
            Some(path) => path,
            None => self.home_store()?,
        };
        // `s3://bucket/prefix` too: the `hindsight` of the Python package has S3 support.
        Ok(Store::open_url(&path.to_string_lossy(), false, None)?)
    }

    /// The store of the project home, if it exists.
    fn home_store(&self) -> Result<PathBuf, Failure> {
        let home = self.home();
        let store = home::store_path(&home);
        if store.is_dir() {
            Ok(store)
        } else {
            Err(Failure::Usage(format!(
                "no store given: pass --store PATH or set HINDSIGHT_STORE \
                 (the project home {} has no store)",
                home.display()
            )))
        }
    }

    /// Open the project's run database; an error if there is none (the CLI
    /// never creates one).
    fn open_db(&self) -> Result<LogDb, Failure> {
        let home = self.home();
        let path = home::db_path(&home);
        home::check_home(&home)?;
        if !path.is_file() {
            return Err(no_project(&home));
        }
        Ok(LogDb::open_checked(&path)?)
    }
}

/// `hindsight repair`: the run database checked, rebuilt if damaged.
fn cmd_repair(places: &Places, out: &mut String) -> Result<i32, Failure> {
    let home = places.home();
    home::check_home(&home)?;
    let path = home::db_path(&home);
    if !path.is_file() {
        return Err(no_project(&home));
    }
    match hindsight_core::runs::db::repair(&path)? {
        Repair::Intact => outln!(out, "{}: intact, nothing to repair", path.display()),
        Repair::Rebuilt { damaged, tables } => {
            outln!(out, "{}: rebuilt from its readable rows", path.display());
            for t in &tables {
                let mut lost = Vec::new();
                if t.unreadable > 0 {
                    lost.push(format!("{} unreadable", t.unreadable));
                }
                if t.bad_sum > 0 {
                    lost.push(format!("{} failed their checksum", t.bad_sum));
                }
                if t.orphaned > 0 {
                    lost.push(format!("{} of a lost run", t.orphaned));
                }
                let lost = if lost.is_empty() {
                    String::new()
                } else {
                    format!("; dropped: {}", lost.join(", "))
                };
                outln!(out, "  {:<10} {} kept{lost}", t.table, t.kept);
            }
            outln!(out, "the damaged file is kept as {}", damaged.display());
        }
    }
    Ok(EXIT_OK)
}

/// `hindsight where`: the project home rule, applied here and said.
fn cmd_where(places: &Places, out: &mut String) -> Result<i32, Failure> {
    let cwd = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
    let (home, why) = match non_empty(places.home.clone()) {
        Some(h) => (h, "--home names it".to_string()),
        None => {
            let (h, source) = home::locate_home(std::env::var_os(home::HOME_ENV), &cwd);
            (h, source.to_string())
        }
    };
    let state = |p: &Path, what: &str| {
        if p.exists() {
            String::new()
        } else {
            format!(" (none yet: the first {what} creates it)")
        }
    };
    let db = home::db_path(&home);
    outln!(out, "home   {}   ({why})", home.display());
    outln!(out, "runs   {}{}", db.display(), state(&db, "recording"));
    match non_empty(places.store.clone()) {
        Some(s) => outln!(
            out,
            "store  {}   (--store or $HINDSIGHT_STORE)",
            s.display()
        ),
        None => {
            let s = home::store_path(&home);
            outln!(out, "store  {}{}", s.display(), state(&s, "checkpoint"));
        }
    }
    outln!(
        out,
        "A training script finds its home the same way, from the script's directory; \
         set ${} to put it elsewhere.",
        home::HOME_ENV
    );
    Ok(EXIT_OK)
}

/// `settings`: the engine's table of variables, each with its value here
/// (a value that does not parse is named, and the exit code is 1).
fn cmd_settings(all: bool, out: &mut String) -> Result<i32, Failure> {
    let mut code = EXIT_OK;
    for s in hindsight_core::settings::ALL
        .iter()
        .filter(|s| all || !s.internal)
    {
        let value = match (s.raw(), s.get()) {
            (None, _) => "unset".to_string(),
            (Some(raw), Ok(_)) => format!("= {}", raw.to_string_lossy()),
            (Some(_), Err(e)) => {
                code = EXIT_FAILURE;
                format!("INVALID: {e}")
            }
        };
        outln!(out, "{} ({}): {value}", s.name, s.kind.as_str());
        outln!(out, "    {}; default: {}", s.doc, s.default);
    }
    Ok(code)
}

fn no_project(home: &Path) -> Failure {
    Failure::Failed(format!(
        "no hindsight project at {} (no logs.db): run a script that uses hindsight first",
        home.display()
    ))
}

/// `show NAME`: the run NAME if the project has one, else the checkpoint NAME.
fn cmd_show_any(
    places: &Places,
    name: &str,
    out: &mut String,
    err: &mut dyn Write,
) -> Result<i32, Failure> {
    let db_path = home::db_path(&places.home());
    let mut db_problem = None;
    if db_path.is_file() {
        let found = LogDb::open_checked(&db_path).and_then(|db| db.run(name).map(|run| (db, run)));
        match found {
            Ok((db, run)) => return runcmds::cmd_show_run(&db, &run, out),
            Err(hindsight_core::Error::NotFound { .. }) => {}
            Err(e) => db_problem = Some(e),
        }
    }
    let result = places
        .open_store(None)
        .and_then(|store| cmd_show(&store, name, out));
    if result.is_err() {
        // The run database might have known NAME: say why it was not asked.
        if let Some(e) = db_problem {
            let _ = writeln!(err, "warning: cannot look for a run named {name}: {e}");
        }
    }
    result
}

// ---------------------------------------------------------------------------
// Commands

/// What `ls` shows about one checkpoint.
struct Summary {
    name: String,
    created_ms: u64,
    logical_bytes: u64,
    arrays: usize,
    manifest: Manifest,
}

impl Summary {
    fn of(manifest: Manifest) -> Self {
        let mut logical_bytes = 0u64;
        manifest
            .root
            .for_each_blob(&mut Vec::new(), &mut |_, b| logical_bytes += b.nbytes);
        Summary {
            name: manifest.name.clone(),
            created_ms: manifest.created_ms,
            logical_bytes,
            arrays: count_arrays(&manifest.root),
            manifest,
        }
    }
}

fn count_arrays(node: &Node) -> usize {
    match node {
        Node::Array(_) | Node::Sharded(_) => 1,
        Node::List(items) | Node::Tuple(items) => items.iter().map(count_arrays).sum(),
        Node::Dict(items) => items.iter().map(|(_, v)| count_arrays(v)).sum(),
        _ => 0,
    }
}

fn cmd_ls(
    store: &Store,
    json: bool,
    out: &mut String,
    err: &mut dyn Write,
) -> Result<i32, Failure> {
    let mut code = EXIT_OK;
    let mut summaries = Vec::new();
    for name in store.list()? {
        // One unreadable checkpoint must not hide the others.
        match store.manifest(&name) {
            Ok(m) => summaries.push(Summary::of(m)),
            Err(e) => {
                let _ = writeln!(err, "error: {e}");
                code = EXIT_FAILURE;
            }
        }
    }
    if json {
        let items: Vec<serde_json::Value> = summaries
            .iter()
            .map(|s| {
                json!({
                    "name": s.name,
                    "created": format_iso8601(s.created_ms),
                    "created_ms": s.created_ms,
                    "logical_bytes": s.logical_bytes,
                    "arrays": s.arrays,
                    "meta": s.manifest.meta,
                })
            })
            .collect();
        outln!(out, "{}", to_json(&serde_json::Value::Array(items)));
        return Ok(code);
    }
    let rows: Vec<Vec<String>> = summaries
        .iter()
        .map(|s| {
            vec![
                s.name.clone(),
                format_utc(s.created_ms),
                human_size(s.logical_bytes),
                s.arrays.to_string(),
            ]
        })
        .collect();
    table(
        &[
            ("NAME", Align::Left),
            ("CREATED", Align::Left),
            ("SIZE", Align::Right),
            ("ARRAYS", Align::Right),
        ],
        &rows,
        out,
    );
    Ok(code)
}

fn cmd_show(store: &Store, name: &str, out: &mut String) -> Result<i32, Failure> {
    let (manifest, rows) = store.describe(name)?;
    outln!(out, "checkpoint  {}", manifest.name);
    outln!(out, "created     {} UTC", format_utc(manifest.created_ms));
    outln!(out, "format      {}", manifest.format);
    for (k, v) in &manifest.meta {
        outln!(out, "meta        {k}={v}");
    }
    outln!(out);
    let total: u64 = rows.iter().map(|(_, _, n)| n).sum();
    let cells: Vec<Vec<String>> = rows
        .into_iter()
        .map(|(key, kind, bytes)| {
            let size = if bytes == 0 {
                "-".to_string()
            } else {
                human_size(bytes)
            };
            vec![key, kind, size]
        })
        .collect();
    table(
        &[
            ("KEY", Align::Left),
            ("TYPE", Align::Left),
            ("SIZE", Align::Right),
        ],
        &cells,
        out,
    );
    outln!(
        out,
        "total: {} ({total} bytes), {}",
        human_size(total),
        plural(count_arrays(&manifest.root) as u64, "array")
    );
    Ok(EXIT_OK)
}

/// `hindsight verify` of the run database: SQLite's full check, rows of no
/// run, and every value row's checksum.
fn cmd_verify_db(path: &Path, out: &mut String) -> i32 {
    match LogDb::open(path).and_then(|db| db.verify()) {
        Ok(()) => {
            outln!(out, "ok   {}: run database intact", path.display());
            EXIT_OK
        }
        Err(e) => {
            outln!(out, "FAIL {}: {e}", path.display());
            EXIT_FAILURE
        }
    }
}

fn cmd_consolidate(
    store: Store,
    name: &str,
    file: &Path,
    path: Option<&str>,
    out: &mut String,
) -> Result<i32, Failure> {
    let keys: Vec<String> = path
        .unwrap_or("")
        .split('/')
        .filter(|k| !k.is_empty())
        .map(str::to_string)
        .collect();
    let replica = hindsight_core::Replica::single(std::sync::Arc::new(store));
    let threads = hindsight_core::checkpoint::replica::default_read_threads();
    let done = hindsight_core::checkpoint::export::safetensors(
        &replica,
        name,
        &keys,
        file,
        threads,
        &|| false,
    )?;
    let _ = writeln!(
        out,
        "wrote {} tensors ({}) of '{name}' to {}",
        done.tensors,
        hindsight_core::units::human_size(done.bytes),
        file.display()
    );
    if !done.skipped.is_empty() {
        let shown: Vec<&str> = done.skipped.iter().take(5).map(String::as_str).collect();
        let more = done.skipped.len().saturating_sub(shown.len());
        let _ = writeln!(
            out,
            "left out {} values that are not tensors: {}{}",
            done.skipped.len(),
            shown.join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        );
    }
    Ok(EXIT_OK)
}

fn cmd_verify(store: &Store, names: Vec<String>, out: &mut String) -> Result<i32, Failure> {
    // A name given twice would be checked (and reported) twice.
    let mut unique = HashSet::new();
    let names: Vec<String> = names
        .into_iter()
        .filter(|n| unique.insert(n.clone()))
        .collect();
    let mut checked: Vec<String> = Vec::new();
    let (count, problems) = store.verify(&names, |name| checked.push(name.to_string()))?;
    for name in &checked {
        let mut failed = false;
        for p in problems
            .iter()
            .filter(|p| p.checkpoint.as_deref() == Some(name.as_str()))
        {
            outln!(out, "FAIL {name}: {}", p.error);
            failed = true;
        }
        if !failed {
            outln!(out, "ok   {name}");
        }
    }
    // Problems not tied to a checkpoint that was checked (none today, but the API allows them).
    for p in problems
        .iter()
        .filter(|p| !p.checkpoint.as_ref().is_some_and(|c| checked.contains(c)))
    {
        let label = p.checkpoint.clone().unwrap_or_else(|| store.location());
        outln!(out, "FAIL {label}: {}", p.error);
    }
    let checkpoints = plural(count as u64, "checkpoint");
    if problems.is_empty() {
        outln!(out, "verified {checkpoints}: all intact");
        Ok(EXIT_OK)
    } else {
        outln!(
            out,
            "verified {checkpoints}: {}",
            plural(problems.len() as u64, "problem")
        );
        Ok(EXIT_FAILURE)
    }
}

fn cmd_rm(
    store: &Store,
    home: &Path,
    names: &[String],
    out: &mut String,
    err: &mut dyn Write,
) -> i32 {
    let mut code = EXIT_OK;
    let mut removed = 0;
    for name in names {
        // A checkpoint of a run under replay stays until the replay ends.
        let held = match hindsight_core::checkpoint::naming::CheckpointId::parse(name) {
            Some(id) => hindsight_core::runs::remove::refuse_if_held(
                home,
                &id.prefix,
                &format!("checkpoint {name} (run {})", id.prefix),
                false,
            ),
            None => Ok(()),
        };
        match held.and_then(|()| store.remove(name)) {
            Ok(()) => {
                outln!(out, "removed {name}");
                removed += 1;
            }
            Err(e) => {
                let _ = writeln!(err, "error: {e}");
                code = EXIT_FAILURE;
            }
        }
    }
    if removed > 0 {
        outln!(
            out,
            "note: the space is reclaimed when you run `hindsight gc`"
        );
    }
    code
}

/// `rm --run ID...`: the runs, with their checkpoints (engine rule:
/// `runs::remove::remove_run`).
fn cmd_rm_runs(
    places: &Places,
    runs: &[String],
    out: &mut String,
    err: &mut dyn Write,
) -> Result<i32, Failure> {
    let db = places.open_db()?;
    let default_store = home::store_path(&places.home())
        .to_string_lossy()
        .into_owned();
    let mut code = EXIT_OK;
    for run in runs {
        match hindsight_core::runs::remove::remove_run(&db, &places.home(), run, &default_store) {
            Ok(r) => {
                let from = r.store.map(|s| format!(" from {s}")).unwrap_or_default();
                outln!(
                    out,
                    "removed run {run} and {}{from}",
                    plural(r.checkpoints.len() as u64, "checkpoint")
                );
            }
            Err(e) => {
                let _ = writeln!(err, "error: {e}");
                code = EXIT_FAILURE;
            }
        }
    }
    if code == EXIT_OK {
        outln!(
            out,
            "note: the space is reclaimed when you run `hindsight gc`"
        );
    }
    Ok(code)
}

fn cmd_gc(store: &Store, out: &mut String, err: &mut dyn Write) -> Result<i32, Failure> {
    let report = store.gc()?;
    outln!(
        out,
        "removed {} ({}), {}",
        plural(report.chunks_removed as u64, "unreferenced chunk"),
        human_size(report.bytes_removed),
        plural(report.staging_files_removed, "staging file")
    );
    Ok(name_unreadable(
        &report.unreadable,
        "every chunk it names was kept",
        err,
    ))
}

/// Name each checkpoint a store-wide command skipped; the exit code.
fn name_unreadable(unreadable: &[(String, String)], kept: &str, err: &mut dyn Write) -> i32 {
    for (name, why) in unreadable {
        let _ = writeln!(
            err,
            "error: checkpoint '{name}' was skipped ({kept}): {why}"
        );
    }
    if unreadable.is_empty() {
        EXIT_OK
    } else {
        EXIT_FAILURE
    }
}

fn cmd_du(
    store: &Store,
    json: bool,
    out: &mut String,
    err: &mut dyn Write,
) -> Result<i32, Failure> {
    let u = store.usage()?;
    let code = name_unreadable(&u.unreadable, "not counted", err);
    let ratio = (u.stored_bytes > 0).then(|| u.logical_bytes as f64 / u.stored_bytes as f64);
    if json {
        let v = json!({
            "store": store.location(),
            "checkpoints": u.checkpoints,
            "logical_bytes": u.logical_bytes,
            "unique_bytes": u.unique_bytes,
            "stored_bytes": u.stored_bytes,
            "dedup_ratio": ratio,
            "chunks": u.chunks,
            "unreferenced_chunks": u.unreferenced_chunks,
            "unreadable": u.unreadable.iter().map(|(n, _)| n).collect::<Vec<_>>(),
        });
        outln!(out, "{}", to_json(&v));
        return Ok(code);
    }
    let sized = |n: u64| format!("{} ({n} bytes)", human_size(n));
    outln!(out, "checkpoints          {}", u.checkpoints);
    outln!(out, "logical size         {}", sized(u.logical_bytes));
    outln!(out, "unique size          {}", sized(u.unique_bytes));
    outln!(out, "stored size          {}", sized(u.stored_bytes));
    match ratio {
        Some(r) => outln!(out, "dedup ratio          {r:.2}x"),
        None => outln!(out, "dedup ratio          -"),
    }
    outln!(out, "chunks               {}", u.chunks);
    if u.unreferenced_chunks > 0 {
        outln!(
            out,
            "unreferenced chunks  {} (run `hindsight gc` to remove them)",
            u.unreferenced_chunks
        );
    } else {
        outln!(out, "unreferenced chunks  0");
    }
    Ok(code)
}

// ---------------------------------------------------------------------------
// Formatting helpers

fn to_json(v: &serde_json::Value) -> String {
    // Serializing a `Value` to a string cannot fail.
    serde_json::to_string_pretty(v).unwrap_or_default()
}

#[derive(Clone, Copy, Debug)]
enum Align {
    Left,
    Right,
}

/// Aligned columns separated by two spaces, with a header line.
fn table(columns: &[(&str, Align)], rows: &[Vec<String>], out: &mut String) {
    let mut widths: Vec<usize> = columns.iter().map(|(h, _)| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let mut line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut s = String::new();
        for (i, cell) in cells.enumerate() {
            if i > 0 {
                s.push_str("  ");
            }
            let pad = widths[i].saturating_sub(cell.chars().count());
            match columns[i].1 {
                Align::Left => {
                    s.push_str(cell);
                    s.push_str(&" ".repeat(pad));
                }
                Align::Right => {
                    s.push_str(&" ".repeat(pad));
                    s.push_str(cell);
                }
            }
        }
        outln!(out, "{}", s.trim_end());
    };
    line(&mut columns.iter().map(|(h, _)| *h));
    for row in rows {
        line(&mut row.iter().map(String::as_str));
    }
}

/// `1 chunk`, `2 chunks`.
fn plural(n: u64, word: &str) -> String {
    if n == 1 {
        format!("{n} {word}")
    } else {
        format!("{n} {word}s")
    }
}

pub use hindsight_core::runs::dates::{format_iso8601, format_utc};
pub use hindsight_core::units::human_size;

/// Subcommands that run Python (workers, matplotlib, TensorBoard's writer).
fn python_only(name: &str) -> Failure {
    Failure::Usage(format!(
        "hindsight {name} is provided by the Python package: run \
         `python -m hindsight {name} ...` (or the `hindsight` command installed by pip)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_align() {
        let mut out = String::new();
        table(
            &[
                ("A", Align::Left),
                ("NUM", Align::Right),
                ("C", Align::Left),
            ],
            &[
                vec!["long".into(), "1".into(), "x".into()],
                vec!["s".into(), "12345".into(), "".into()],
            ],
            &mut out,
        );
        assert_eq!(out, "A       NUM  C\nlong      1  x\ns     12345\n");
    }

    fn run_str(args: &[&str]) -> (i32, String, String) {
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = run(
            std::iter::once("hindsight").chain(args.iter().copied()),
            &mut out,
            &mut err,
        );
        (
            code,
            String::from_utf8(out).unwrap(),
            String::from_utf8(err).unwrap(),
        )
    }

    #[test]
    fn help_and_version_go_to_out() {
        let (code, out, err) = run_str(&["--help"]);
        assert_eq!(code, 0);
        assert!(out.contains("Usage: hindsight"), "{out}");
        assert!(out.contains("verify"), "{out}");
        assert_eq!(err, "");

        let (code, out, err) = run_str(&["--version"]);
        assert_eq!(code, 0);
        assert_eq!(out, format!("hindsight {}\n", env!("CARGO_PKG_VERSION")));
        assert_eq!(err, "");
    }

    #[test]
    fn usage_errors_go_to_err_with_code_2() {
        let (code, out, err) = run_str(&["frobnicate"]);
        assert_eq!(code, 2);
        assert_eq!(out, "");
        assert!(
            err.contains("unrecognized subcommand 'frobnicate'"),
            "{err}"
        );
        // Plain text: no terminal colour codes in captured output.
        assert!(!err.contains('\x1b'), "{err:?}");

        let (code, _, err) = run_str(&["rm", "--store", "/nonexistent"]);
        assert_eq!(code, 2);
        assert!(err.contains("<NAME>..."), "{err}");

        let (code, out, _) = run_str(&[]);
        assert_eq!(code, 2);
        assert_eq!(out, "");
    }
}
