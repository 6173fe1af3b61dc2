//! Dates as hindsight shows and stores them: UTC, from milliseconds since
//! the Unix epoch. The calendar is jiff's; this module only fixes formats.

use std::time::{SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

fn format(ms: u64, pattern: &str) -> String {
    let ms = i64::try_from(ms).unwrap_or(i64::MAX);
    match jiff::Timestamp::from_millisecond(ms) {
        Ok(t) => t.strftime(pattern).to_string(),
        // Beyond year 9999: say so rather than print a wrong date.
        Err(_) => format!("@{ms}ms"),
    }
}

/// `YYYYMMDD-HHMMSS`: the date part of run ids.
pub fn compact_utc(ms: u64) -> String {
    format(ms, "%Y%m%d-%H%M%S")
}

/// `YYYY-MM-DD HH:MM:SS` in UTC.
pub fn format_utc(ms: u64) -> String {
    format(ms, "%Y-%m-%d %H:%M:%S")
}

/// `YYYY-MM-DDTHH:MM:SSZ` (RFC 3339, UTC).
pub fn format_iso8601(ms: u64) -> String {
    format(ms, "%Y-%m-%dT%H:%M:%SZ")
}

/// Milliseconds since the epoch of a date the user typed, in UTC:
/// `YYYY-MM-DD`, `YYYY-MM-DD HH:MM[:SS]`, or RFC 3339 with `T`/offset.
pub fn parse_utc(text: &str) -> crate::Result<u64> {
    let t = text.trim();
    let bad = || {
        crate::Error::invalid(
            "date",
            format!("'{text}' is not a date (YYYY-MM-DD, YYYY-MM-DD HH:MM[:SS], or RFC 3339)"),
        )
    };
    let ts = if let Ok(ts) = t.parse::<jiff::Timestamp>() {
        ts
    } else if let Ok(dt) = t.replace(' ', "T").parse::<jiff::civil::DateTime>() {
        dt.to_zoned(jiff::tz::TimeZone::UTC)
            .map_err(|_| bad())?
            .timestamp()
    } else if let Ok(d) = t.parse::<jiff::civil::Date>() {
        d.to_zoned(jiff::tz::TimeZone::UTC)
            .map_err(|_| bad())?
            .timestamp()
    } else {
        return Err(bad());
    };
    u64::try_from(ts.as_millisecond()).map_err(|_| bad())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn typed_dates_parse_as_utc() {
        assert_eq!(parse_utc("2023-11-14").unwrap(), 1_699_920_000_000);
        assert_eq!(parse_utc("2023-11-14 22:13:20").unwrap(), 1_700_000_000_000);
        assert_eq!(parse_utc("2023-11-14T22:13").unwrap(), 1_699_999_980_000);
        assert_eq!(
            parse_utc("2023-11-14T23:13:20+01:00").unwrap(),
            1_700_000_000_000
        );
        assert!(parse_utc("yesterday").is_err());
        assert!(parse_utc("2023-13-01").is_err());
    }

    #[test]
    fn dates_match_known_instants() {
        assert_eq!(format_utc(0), "1970-01-01 00:00:00");
        assert_eq!(format_utc(999), "1970-01-01 00:00:00");
        assert_eq!(format_utc(86_399_999), "1970-01-01 23:59:59");
        assert_eq!(format_utc(951_782_400_000), "2000-02-29 00:00:00");
        assert_eq!(format_utc(1_709_251_199_000), "2024-02-29 23:59:59");
        assert_eq!(format_utc(1_709_251_200_000), "2024-03-01 00:00:00");
        assert_eq!(format_utc(4_107_542_400_000), "2100-03-01 00:00:00");
        assert_eq!(format_iso8601(1_700_000_000_123), "2023-11-14T22:13:20Z");
        assert_eq!(compact_utc(1_700_000_000_123), "20231114-221320");
        assert_eq!(format_utc(u64::MAX), format!("@{}ms", i64::MAX));
    }
}
