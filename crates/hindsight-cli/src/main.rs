//! The `hindsight` binary: a thin shell around [`hindsight_cli::run`].

use std::process::ExitCode;

fn main() -> ExitCode {
    let stdout = std::io::stdout();
    let stderr = std::io::stderr();
    let code = hindsight_cli::run(std::env::args_os(), &mut stdout.lock(), &mut stderr.lock());
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
