//! The commands whose work is Python's: replay (Python workers), plot and
//! export (matplotlib, TensorBoard's writer), record (the training script)
//! and the input service's processes (a worker runs the user's dataset).
//!
//! Their grammar is here, in the one clap tree of `hindsight`, so that
//! `hindsight --help`, `hindsight replay --help` and every usage error come
//! from one place; [`crate::dispatch`] hands the parsed arguments to the
//! Python package, which only carries them out.

use std::path::PathBuf;

use clap::{Args, Subcommand};

/// Most replay workers at once: far past any machine's cores (a typo
/// otherwise overflows the engine's integer).
pub const MAX_JOBS: u32 = 4096;

/// Where a replay's workers run (`hindsight._launch.LAUNCHERS`: a launcher
/// added there is named here too).
pub const LAUNCHERS: [&str; 2] = ["local", "slurm"];

/// `hindsight replay`.
#[derive(Debug, Clone, Args)]
pub struct ReplayArgs {
    /// The training script, with new hs.log statements
    #[arg(value_name = "SCRIPT")]
    pub script: String,
    /// A run id to replay (repeatable; default: the latest run of SCRIPT)
    #[arg(long = "run", value_name = "ID")]
    pub run: Vec<String>,
    /// Several runs: 'all' recorded runs of SCRIPT, or these ids; runs
    /// recorded from another version of the script get the new statements
    /// placed into their own recorded source
    #[arg(long, value_name = "all|ID", num_args = 1..)]
    pub runs: Option<Vec<String>>,
    /// Only runs started at or after DATE (UTC: YYYY-MM-DD[ HH:MM])
    #[arg(long, value_name = "DATE")]
    pub since: Option<String>,
    /// Worker processes for inner-loop probes
    #[arg(
        short = 'j',
        long,
        value_name = "N",
        default_value_t = 1,
        value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_JOBS))
    )]
    pub jobs: u32,
    /// Only these outer iterations, e.g. 'epoch >= 10'
    #[arg(long = "where", value_name = "EXPR")]
    pub where_: Option<String>,
    /// Replay even if the script changed beyond logging
    #[arg(long)]
    pub force: bool,
    /// Keep the values of a replay whose recomputed values differ from the
    /// recorded ones (marked 'diverged'; by default they are discarded and
    /// the replay exits 3)
    #[arg(long)]
    pub allow_divergence: bool,
    /// Run -j workers at once with cores/j threads each, even where the
    /// recording used more threads: values may differ in the last bits
    /// (compared within a tolerance, kept marked 'inexact')
    #[arg(long)]
    pub fast: bool,
    /// A multi-rank run's workers that only restore checkpoints (new values
    /// at the outer loop's level) run on the recorded ranks too, not on one
    /// process: for epoch code whose values depend on the world size (an
    /// all_reduce, a DistributedSampler's share)
    #[arg(long)]
    pub recorded_ranks: bool,
    /// The default now; kept for old scripts
    #[arg(long, hide = true)]
    pub strict: bool,
    /// Hide the workers' standard output
    #[arg(short = 'q', long)]
    pub quiet: bool,
    /// Where the workers run: processes here, or a Slurm job array (one
    /// task per worker; the project home and the store must be visible to
    /// the nodes)
    #[arg(long, value_name = "NAME", default_value = "local", value_parser = LAUNCHERS)]
    pub launcher: String,
    /// An option for sbatch with --launcher slurm, e.g. --sbatch=--partition=gpu (repeatable)
    #[arg(long, value_name = "ARG", allow_hyphen_values = true)]
    pub sbatch: Vec<String>,
}

/// The logged series `plot` and `export` read.
#[derive(Debug, Clone, Args)]
pub struct Series {
    /// Logged names (hs.log)
    #[arg(value_name = "NAME", required = true)]
    pub names: Vec<String>,
    /// A run to read (repeatable; default: the latest)
    #[arg(long = "run", value_name = "ID")]
    pub run: Vec<String>,
}

/// `hindsight plot`.
#[derive(Debug, Clone, Args)]
pub struct PlotArgs {
    #[command(flatten)]
    pub series: Series,
    /// The figure (png, pdf, svg)
    #[arg(short = 'o', long, value_name = "FILE.png")]
    pub output: PathBuf,
}

/// `hindsight export`.
#[derive(Debug, Clone, Args)]
pub struct ExportArgs {
    #[command(flatten)]
    pub series: Series,
    /// Write event files under DIR/<run>/
    #[arg(long, value_name = "DIR")]
    pub tensorboard: PathBuf,
}

/// `hindsight record`.
#[derive(Debug, Clone, Args)]
pub struct RecordArgs {
    /// Only say what the script's checkpoints would hold and why, recording nothing
    #[arg(long)]
    pub explain: bool,
    /// The training script and its arguments
    #[arg(
        value_name = "SCRIPT [ARGS]",
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true
    )]
    pub command: Vec<String>,
}

/// `hindsight data ...`: the input service's processes.
#[derive(Debug, Clone, Subcommand)]
pub enum DataCommand {
    /// The input service's dispatcher, here until Ctrl-C or SIGTERM
    Dispatcher(DispatcherArgs),
    /// Serve a dataset for a dispatcher
    Worker(WorkerArgs),
    /// A job token for the trainers of one dataset's jobs
    ///
    /// Derived from the service's token (from --journal's token file, or
    /// $HINDSIGHT_DATA_TOKEN / $HINDSIGHT_DATA_TOKEN_FILE). With it a
    /// trainer reads its dataset's jobs and can do nothing else: not
    /// register a worker, list the service, or touch another dataset's job.
    Token(TokenArgs),
}

/// `hindsight data dispatcher`.
#[derive(Debug, Clone, Args)]
pub struct DispatcherArgs {
    /// Directory of its journal, on the dispatcher's local disk
    #[arg(long, value_name = "DIR")]
    pub journal: PathBuf,
    /// The port to listen on
    #[arg(long, default_value_t = 50051)]
    pub port: u16,
    /// The address to listen on (127.0.0.1: this machine only; 0.0.0.0 for
    /// workers on other machines)
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Seconds of silence before a worker is dead
    // A negative value reaches the dispatcher, which owns the rule and names it.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 1.0,
        allow_negative_numbers = true
    )]
    pub heartbeat_timeout: f64,
}

/// `hindsight data worker`.
#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {
    /// host:port of the dispatcher
    #[arg(long)]
    pub dispatcher: String,
    /// module:factory returning a map-style dataset
    #[arg(long)]
    pub dataset: String,
    /// JSON keyword arguments of the factory
    #[arg(long, value_name = "JSON", default_value = "{}")]
    pub args: String,
    /// module:function (default: torch's default_collate)
    #[arg(long)]
    pub collate: Option<String>,
    /// Where to listen (127.0.0.1, any port: this machine only; 0.0.0.0:0
    /// for trainers elsewhere)
    #[arg(long, default_value = "127.0.0.1:0")]
    pub bind: String,
    /// host[:port] clients use to reach this worker (port 0 or none: the bound port)
    #[arg(long)]
    pub advertise: Option<String>,
    /// Stop when this process is gone (local workers)
    #[arg(long, value_name = "PID")]
    pub parent_pid: Option<u32>,
    /// A hindsight store (path or s3://) for worker checkpoints of sharded
    /// splits, shared by the workers
    #[arg(long, value_name = "STORE")]
    pub checkpoints: Option<String>,
    /// Share of production time checkpoint stalls may take (0: none)
    #[arg(
        long,
        value_name = "SHARE",
        default_value_t = 0.05,
        allow_negative_numbers = true
    )]
    pub checkpoint_overhead: f64,
    /// Hand large units over through files in this shared-memory directory
    /// (workers on the client's host)
    #[arg(long, value_name = "DIR")]
    pub shared_dir: Option<PathBuf>,
}

/// `hindsight data token`.
#[derive(Debug, Clone, Args)]
pub struct TokenArgs {
    /// The dataset factory the jobs name (module.function)
    #[arg(long)]
    pub dataset: String,
    /// The dispatcher's journal directory (its token file)
    #[arg(long, value_name = "DIR")]
    pub journal: Option<PathBuf>,
}

/// A command the Python package carries out, parsed.
#[derive(Debug, Clone)]
pub enum PythonCommand {
    Replay(ReplayArgs),
    Plot(PlotArgs),
    Export(ExportArgs),
    Record(RecordArgs),
    Data(DataCommand),
}

impl PythonCommand {
    /// The subcommand's name, as typed.
    pub fn name(&self) -> &'static str {
        match self {
            PythonCommand::Replay(_) => "replay",
            PythonCommand::Plot(_) => "plot",
            PythonCommand::Export(_) => "export",
            PythonCommand::Record(_) => "record",
            PythonCommand::Data(_) => "data",
        }
    }
}

/// A Python command with the global options given with it.
#[derive(Debug, Clone)]
pub struct PythonCall {
    pub command: PythonCommand,
    /// `--home`, where given.
    pub home: Option<PathBuf>,
    /// `--store`/`-s` was given on the command line (not by $HINDSIGHT_STORE).
    pub store_given: bool,
}
