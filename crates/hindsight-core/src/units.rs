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

#[cfg(test)]
mod tests {
    use super::*;

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
