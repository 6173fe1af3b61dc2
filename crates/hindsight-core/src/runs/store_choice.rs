//! Which store a run writes its checkpoints to, and through which local
//! directory: the one rule every front end asks (an `hs.loop` recording and
//! its replay, and the Lightning and Trainer callbacks when given no store
//! of their own).
//!
//! A run that already wrote somewhere (resumed, or replayed) keeps that
//! store. Otherwise the store given in code (`hs.checkpointing(store=...)`)
//! wins over `$HINDSIGHT_STORE`, which wins over `<home>/store`. The
//! local-first directory is likewise the code's, else
//! `$HINDSIGHT_LOCAL_FIRST`; it is dropped where it is the store itself,
//! and a replay never reads through one (it reads where the run wrote).

use std::ffi::OsString;
use std::path::Path;

use crate::checkpoint::location::Location;
use crate::settings::{self, Value};
use crate::Result;

/// What a front end knows when it asks (all optional but the home).
#[derive(Debug, Clone, Copy, Default)]
pub struct StoreAsk<'a> {
    /// The store the run's database names: a resumed or replayed run's.
    pub recorded: Option<&'a str>,
    /// The store given in code.
    pub explicit: Option<&'a str>,
    /// The local-first directory given in code.
    pub local_first: Option<&'a str>,
    /// A replay: it reads the recorded store, never through a cache.
    pub replay: bool,
}

/// The answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreChoice {
    /// The store's location, normalized (a path or an object-store URL).
    pub location: String,
    /// A local directory saves go to first, or `None`.
    pub local_first: Option<String>,
    /// The store asked for (in code or in the environment) that a resumed
    /// run does not take, for the line that says so.
    pub declined: Option<String>,
}

/// The choice for `ask` in the project `home`, with the environment's
/// `$HINDSIGHT_STORE` and `$HINDSIGHT_LOCAL_FIRST` (passed in: the caller
/// reads the environment). A location that does not parse is an error
/// naming where it came from.
pub fn choose_store(
    ask: StoreAsk<'_>,
    home: &Path,
    env_store: Option<OsString>,
    env_local: Option<OsString>,
) -> Result<StoreChoice> {
    let configured = match ask.explicit {
        Some(text) => Some(Location::parse(text, "store")?.to_string()),
        None => env_text(&settings::STORE, env_store)?
            .map(|text| Location::parse(&text, settings::STORE.name).map(|l| l.to_string()))
            .transpose()?,
    };
    let location = match ask.recorded {
        Some(recorded) => recorded.to_string(),
        None => configured
            .clone()
            .unwrap_or_else(|| crate::runs::project::store_path(home).display().to_string()),
    };
    if ask.replay {
        return Ok(StoreChoice {
            location,
            local_first: None,
            declined: None,
        });
    }
    let local = match ask.local_first {
        Some(text) => Some(Location::parse_local(text, "local_first")?),
        None => env_text(&settings::LOCAL_FIRST, env_local)?
            .map(|text| Location::parse_local(&text, settings::LOCAL_FIRST.name))
            .transpose()?,
    }
    .map(|p| p.display().to_string())
    .filter(|p| *p != location);
    let declined = configured.filter(|c| ask.recorded.is_some() && *c != location);
    Ok(StoreChoice {
        location,
        local_first: local,
        declined,
    })
}

fn env_text(setting: &settings::Setting, raw: Option<OsString>) -> Result<Option<String>> {
    Ok(match setting.parse(raw)? {
        Some(Value::Text(text)) => Some(text),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn choose(ask: StoreAsk<'_>, env: Option<&str>, local: Option<&str>) -> Result<StoreChoice> {
        choose_store(
            ask,
            Path::new("/p/.hindsight"),
            env.map(OsString::from),
            local.map(OsString::from),
        )
    }

    #[test]
    fn code_wins_over_the_environment_which_wins_over_the_home() {
        let home = choose(StoreAsk::default(), None, None).unwrap();
        assert_eq!(home.location, "/p/.hindsight/store");
        let env = choose(StoreAsk::default(), Some("s3://b/e"), None).unwrap();
        assert_eq!(env.location, "s3://b/e");
        let code = StoreAsk {
            explicit: Some("az://c/x"),
            ..StoreAsk::default()
        };
        assert_eq!(
            choose(code, Some("s3://b/e"), None).unwrap().location,
            "az://c/x"
        );
        // An empty variable is unset.
        assert_eq!(choose(StoreAsk::default(), Some(""), None).unwrap(), home);
    }

    #[test]
    fn a_resumed_run_keeps_its_store_and_says_which_it_declined() {
        let ask = StoreAsk {
            recorded: Some("/old/store"),
            ..StoreAsk::default()
        };
        let c = choose(ask, Some("/new/store"), None).unwrap();
        assert_eq!(c.location, "/old/store");
        assert_eq!(c.declined.as_deref(), Some("/new/store"));
        assert_eq!(
            choose(ask, Some("/old/store"), None).unwrap().declined,
            None
        );
        assert_eq!(choose(ask, None, None).unwrap().declined, None);
    }

    #[test]
    fn local_first_comes_from_code_or_the_environment_and_never_reaches_a_replay() {
        let ask = StoreAsk {
            explicit: Some("s3://b/p"),
            local_first: Some("/fast"),
            ..StoreAsk::default()
        };
        assert_eq!(
            choose(ask, None, Some("/env"))
                .unwrap()
                .local_first
                .as_deref(),
            Some("/fast")
        );
        let env_only = StoreAsk {
            explicit: Some("s3://b/p"),
            ..StoreAsk::default()
        };
        assert_eq!(
            choose(env_only, None, Some("/env"))
                .unwrap()
                .local_first
                .as_deref(),
            Some("/env")
        );
        // The store itself is no cache of itself.
        let same = StoreAsk {
            explicit: Some("/s"),
            local_first: Some("/s"),
            ..StoreAsk::default()
        };
        assert_eq!(choose(same, None, None).unwrap().local_first, None);
        let replay = StoreAsk {
            recorded: Some("s3://b/p"),
            replay: true,
            ..StoreAsk::default()
        };
        let c = choose(replay, Some("/other"), Some("/env")).unwrap();
        assert_eq!(
            (c.location.as_str(), c.local_first, c.declined),
            ("s3://b/p", None, None)
        );
    }

    #[test]
    fn a_bad_location_names_where_it_came_from() {
        let e = choose(StoreAsk::default(), Some("s3://"), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("HINDSIGHT_STORE"), "{e}");
        let e = choose(StoreAsk::default(), None, Some("s3://b/p"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("HINDSIGHT_LOCAL_FIRST") && e.contains("local directory"),
            "{e}"
        );
        let code = StoreAsk {
            local_first: Some("az://c/p"),
            ..StoreAsk::default()
        };
        let e = choose(code, None, None).unwrap_err().to_string();
        assert!(e.contains("local_first"), "{e}");
    }
}
