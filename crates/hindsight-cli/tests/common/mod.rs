//! What the CLI test files share.

/// Run `f` (insta snapshot assertions) with what differs from run to run
/// masked: `YYYY-MM-DD HH:MM:SS` timestamps (a checkpoint's creation time).
pub(crate) fn masked<R>(f: impl FnOnce() -> R) -> R {
    let mut settings = insta::Settings::clone_current();
    settings.add_filter(
        r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}",
        "YYYY-MM-DD hh:mm:ss",
    );
    settings.bind(f)
}
