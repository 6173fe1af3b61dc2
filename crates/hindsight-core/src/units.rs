//! Quantities for people: the CLI's tables and a recording's lines use one
//! spelling.

/// A byte count for people: `512 B`, `1.5 KiB`, `3.0 MiB`, `1.2 GiB`, `2.0 TiB`.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    // Move up a unit whenever one decimal would round to 1024.0.
    while unit + 1 < UNITS.len() && (value * 10.0).round() >= 10240.0 {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// A byte count as people write it: `4096`, `500MB`, `1.5 GiB`, `16g`
/// (K/M/G/T: powers of 1000 with `B`, of 1024 with `iB` or alone). `None`
/// where it is not one.
pub fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let value: f64 = number.parse().ok()?;
    let unit = unit.trim().to_ascii_lowercase();
    let scale = match unit.as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return None,
    };
    let bytes = value * scale;
    (value.is_finite() && bytes < u64::MAX as f64).then(|| bytes.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_as_people_write_them() {
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size(" 500MB "), Some(500_000_000));
        assert_eq!(parse_size("1.5 GiB"), Some(3 << 29));
        assert_eq!(parse_size("16g"), Some(16 << 30));
        assert_eq!(parse_size("2TiB"), Some(2 << 40));
        for bad in ["", "GiB", "1.2.3G", "-5G", "5 parsecs", "1e400"] {
            assert_eq!(parse_size(bad), None, "{bad}");
        }
    }

    #[test]
    fn sizes_are_human() {
        assert_eq!(human_size(0), "0 B");
        assert_eq!(human_size(1023), "1023 B");
        assert_eq!(human_size(1024), "1.0 KiB");
        assert_eq!(human_size(1536), "1.5 KiB");
        assert_eq!(human_size(1024 * 1024 - 1), "1.0 MiB");
        assert_eq!(human_size(5 << 20), "5.0 MiB");
        assert_eq!(human_size(3 << 30), "3.0 GiB");
        assert_eq!(human_size(2 << 40), "2.0 TiB");
        assert_eq!(human_size(2048 << 40), "2048.0 TiB");
    }
}
