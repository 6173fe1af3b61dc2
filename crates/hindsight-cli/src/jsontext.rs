//! JSON as text. Values in the run database are JSON text as Python's
//! `json.dumps` wrote it: object keys in the order the user wrote them, and
//! maybe `NaN`, `Infinity` or `-Infinity`, which `serde_json` can neither
//! parse nor write. These helpers reformat such text without parsing it
//! into values, so nothing is reordered or lost.

use std::fmt::Write as _;

/// `text` without the whitespace outside strings: `{"a": [1, 2]}` becomes
/// `{"a":[1,2]}`.
pub(crate) fn compact(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut in_string = false;
    let mut escaped = false;
    for c in text.chars() {
        if in_string {
            out.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if c == '"' {
            in_string = true;
            out.push(c);
        } else if !c.is_whitespace() {
            out.push(c);
        }
    }
    out
}

/// `text` indented like `serde_json::to_string_pretty` writes (two spaces
/// per level, `"key": value`, empty containers as `{}` and `[]`).
pub(crate) fn pretty(text: &str) -> String {
    let chars: Vec<char> = compact(text).chars().collect();
    let mut out = String::with_capacity(chars.len() * 2);
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    let newline = |out: &mut String, depth: usize| {
        out.push('\n');
        out.push_str(&"  ".repeat(depth));
    };
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        i += 1;
        if in_string {
            out.push(c);
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
            continue;
        }
        match c {
            '"' => {
                in_string = true;
                out.push(c);
            }
            '{' | '[' => {
                out.push(c);
                let close = if c == '{' { '}' } else { ']' };
                if chars.get(i) == Some(&close) {
                    out.push(close);
                    i += 1;
                } else {
                    depth += 1;
                    newline(&mut out, depth);
                }
            }
            '}' | ']' => {
                depth = depth.saturating_sub(1);
                newline(&mut out, depth);
                out.push(c);
            }
            ',' => {
                out.push(c);
                newline(&mut out, depth);
            }
            ':' => out.push_str(": "),
            _ => out.push(c),
        }
    }
    out
}

/// The members of a JSON object as (key, compact value text), in the order
/// of the text; `None` if `text` is not an object (or a key is not a string).
pub(crate) fn members(text: &str) -> Option<Vec<(String, String)>> {
    let text = compact(text);
    let inner = text.strip_prefix('{')?.strip_suffix('}')?;
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    let (mut in_string, mut escaped) = (false, false);
    for (i, c) in inner.char_indices() {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '{' | '[' => depth += 1,
            '}' | ']' => depth = depth.checked_sub(1)?,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if !inner.is_empty() {
        parts.push(&inner[start..]);
    }
    parts
        .into_iter()
        .map(|member| {
            // The key is a string literal, so the first `":` outside it ends it.
            let key_end = member.starts_with('"').then(|| {
                let mut escaped = false;
                member[1..].char_indices().find_map(|(i, c)| {
                    if escaped {
                        escaped = false;
                        None
                    } else if c == '\\' {
                        escaped = true;
                        None
                    } else {
                        (c == '"').then_some(i + 2)
                    }
                })
            })??;
            let key: String = serde_json::from_str(&member[..key_end]).ok()?;
            let value = member[key_end..].strip_prefix(':')?;
            Some((key, value.to_string()))
        })
        .collect()
}

/// A JSON string literal.
pub(crate) fn string(s: &str) -> String {
    // Serializing a &str cannot fail.
    serde_json::to_string(s).unwrap_or_default()
}

/// Builds the text of a JSON object whose members are JSON texts.
#[derive(Debug)]
pub(crate) struct Object(String);

impl Object {
    pub(crate) fn new() -> Self {
        Object(String::from("{"))
    }

    /// Add a member whose value is JSON text, written as given.
    pub(crate) fn raw(&mut self, key: &str, json: &str) -> &mut Self {
        if self.0.len() > 1 {
            self.0.push(',');
        }
        let _ = write!(self.0, "{}:{json}", string(key));
        self
    }

    /// Add a member holding a `serde_json` value.
    pub(crate) fn value(&mut self, key: &str, value: &serde_json::Value) -> &mut Self {
        // Serializing a `Value` cannot fail.
        self.raw(key, &serde_json::to_string(value).unwrap_or_default())
    }

    pub(crate) fn finish(&mut self) -> String {
        let mut text = std::mem::take(&mut self.0);
        text.push('}');
        text
    }
}

/// The text of a JSON array of JSON texts.
pub(crate) fn array(items: &[String]) -> String {
    format!("[{}]", items.join(","))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn compact_keeps_strings_order_and_non_finite_numbers() {
        assert_eq!(
            compact("{\"b\": [1, 2.50, NaN],\n \"a\": \"x, y: \\\" z\"}"),
            "{\"b\":[1,2.50,NaN],\"a\":\"x, y: \\\" z\"}"
        );
        assert_eq!(compact(" -Infinity "), "-Infinity");
        assert_eq!(compact("\"a\\\\\" "), "\"a\\\\\"");
    }

    #[test]
    fn pretty_matches_serde_json() {
        for v in [
            json!({"lr": 0.1, "layers": [64, 32], "opt": {"name": "sgd, \"fast\"", "m": []}}),
            json!([]),
            json!({}),
            json!([{"a": {}}, [1, [2, []]], "x:{y}"]),
            json!("plain"),
            json!(3),
        ] {
            let text = serde_json::to_string(&v).unwrap_or_default();
            assert_eq!(
                pretty(&text),
                serde_json::to_string_pretty(&v).unwrap_or_default()
            );
        }
        assert_eq!(
            pretty("{\"z\": NaN, \"a\": [Infinity]}"),
            "{\n  \"z\": NaN,\n  \"a\": [\n    Infinity\n  ]\n}"
        );
    }

    #[test]
    fn members_keep_their_order() {
        assert_eq!(
            members(r#"{"x": "z", "y": [1, {"a": 2}], "z": NaN, "q\"u": "v,w"}"#),
            Some(vec![
                ("x".into(), "\"z\"".into()),
                ("y".into(), "[1,{\"a\":2}]".into()),
                ("z".into(), "NaN".into()),
                ("q\"u".into(), "\"v,w\"".into()),
            ])
        );
        assert_eq!(members("{}"), Some(vec![]));
        assert_eq!(members(" { } "), Some(vec![]));
        assert_eq!(members("[1]"), None);
        assert_eq!(members("3"), None);
        assert_eq!(members("{1: 2}"), None);
    }

    #[test]
    fn objects_and_arrays() {
        let mut o = Object::new();
        o.raw("v", "NaN")
            .value("s", &json!("a\"b"))
            .raw("n", "null");
        let text = o.finish();
        assert_eq!(text, r#"{"v":NaN,"s":"a\"b","n":null}"#);
        assert_eq!(array(&[]), "[]");
        assert_eq!(
            array(&["1".into(), text]),
            r#"[1,{"v":NaN,"s":"a\"b","n":null}]"#
        );
        assert_eq!(Object::new().finish(), "{}");
    }
}
