//! JSON as text, the one JSON module of hindsight. Values in the run
//! database are JSON text as Python's `json.dumps` wrote it: object keys in
//! the order the user wrote them, and maybe `NaN`, `Infinity` or
//! `-Infinity`, which `serde_json` can neither parse nor write. Everything
//! that checks, compares or reformats such text lives here, so every caller
//! (the run database, the CLI, the binding) accepts the same values.

use std::fmt::Write as _;

use crate::error::{Error, Result};

/// Whether two JSON values are the same: structurally (object key order and
/// whitespace do not matter), numbers compared as numbers (`1` = `1.0`,
/// `NaN` = `NaN`; integers exactly). Unparsable text compares as text.
pub fn values_equal(a: &str, b: &str) -> bool {
    values_close(a, b, 0.0)
}

/// Like [`values_equal`], but floating-point numbers may differ by a
/// relative `rtol` (`|x - y| <= rtol * max(|x|, |y|)`): the comparison of a
/// replay that ran with another thread count than the recording, whose sums
/// may round differently in the last bits. `rtol = 0` is [`values_equal`].
pub fn values_close(a: &str, b: &str, rtol: f64) -> bool {
    let (a, b) = (a.trim(), b.trim());
    if a == b {
        return true;
    }
    match (parse(a), parse(b)) {
        (Some(x), Some(y)) => equal(&x, &y, rtol),
        _ => false,
    }
}

/// A parsed JSON value; numbers keep their literal text.
#[derive(Debug, PartialEq)]
pub(crate) enum J {
    Null,
    Bool(bool),
    /// The number's literal text.
    Num(String),
    Str(String),
    Arr(Vec<J>),
    Obj(Vec<(String, J)>),
}

const MAX_DEPTH: usize = 256;

pub(crate) fn parse(text: &str) -> Option<J> {
    let mut p = Parser {
        s: text.as_bytes(),
        text,
        i: 0,
    };
    let v = p.value(0)?;
    p.ws();
    (p.i == p.s.len()).then_some(v)
}

struct Parser<'a> {
    s: &'a [u8],
    text: &'a str,
    i: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && matches!(self.s[self.i], b' ' | b'\t' | b'\n' | b'\r') {
            self.i += 1;
        }
    }

    fn lit(&mut self, word: &str) -> bool {
        if self.s[self.i..].starts_with(word.as_bytes()) {
            self.i += word.len();
            true
        } else {
            false
        }
    }

    fn value(&mut self, depth: usize) -> Option<J> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.ws();
        match *self.s.get(self.i)? {
            b'n' => self.lit("null").then_some(J::Null),
            b't' => self.lit("true").then_some(J::Bool(true)),
            b'f' => self.lit("false").then_some(J::Bool(false)),
            b'N' => self.lit("NaN").then(|| J::Num("NaN".into())),
            b'I' => self.lit("Infinity").then(|| J::Num("Infinity".into())),
            b'-' if self.s.get(self.i + 1) == Some(&b'I') => {
                self.lit("-Infinity").then(|| J::Num("-Infinity".into()))
            }
            b'-' | b'0'..=b'9' => self.number(),
            b'"' => self.string().map(J::Str),
            b'[' => {
                self.i += 1;
                let mut items = Vec::new();
                self.ws();
                if self.s.get(self.i) == Some(&b']') {
                    self.i += 1;
                    return Some(J::Arr(items));
                }
                loop {
                    items.push(self.value(depth + 1)?);
                    self.ws();
                    match *self.s.get(self.i)? {
                        b',' => self.i += 1,
                        b']' => {
                            self.i += 1;
                            return Some(J::Arr(items));
                        }
                        _ => return None,
                    }
                }
            }
            b'{' => {
                self.i += 1;
                let mut entries = Vec::new();
                self.ws();
                if self.s.get(self.i) == Some(&b'}') {
                    self.i += 1;
                    return Some(J::Obj(entries));
                }
                loop {
                    self.ws();
                    let key = self.string()?;
                    self.ws();
                    if self.s.get(self.i) != Some(&b':') {
                        return None;
                    }
                    self.i += 1;
                    entries.push((key, self.value(depth + 1)?));
                    self.ws();
                    match *self.s.get(self.i)? {
                        b',' => self.i += 1,
                        b'}' => {
                            self.i += 1;
                            return Some(J::Obj(entries));
                        }
                        _ => return None,
                    }
                }
            }
            _ => None,
        }
    }

    fn number(&mut self) -> Option<J> {
        let start = self.i;
        while self.i < self.s.len()
            && matches!(
                self.s[self.i],
                b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9'
            )
        {
            self.i += 1;
        }
        let tok = &self.text[start..self.i];
        // Rust's float grammar is a superset of JSON's number grammar.
        tok.parse::<f64>().ok()?;
        Some(J::Num(tok.to_string()))
    }

    fn string(&mut self) -> Option<String> {
        if self.s.get(self.i) != Some(&b'"') {
            return None;
        }
        let start = self.i;
        self.i += 1;
        loop {
            match *self.s.get(self.i)? {
                b'\\' => self.i += 2,
                b'"' => {
                    self.i += 1;
                    break;
                }
                _ => self.i += 1,
            }
        }
        serde_json::from_str(self.text.get(start..self.i)?).ok()
    }
}

fn is_int(tok: &str) -> bool {
    let digits = tok.strip_prefix('-').unwrap_or(tok);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
}

fn num_equal(a: &str, b: &str, rtol: f64) -> bool {
    if is_int(a) && is_int(b) {
        if let (Ok(x), Ok(y)) = (a.parse::<i128>(), b.parse::<i128>()) {
            return x == y;
        }
    }
    match (a.parse::<f64>(), b.parse::<f64>()) {
        (Ok(x), Ok(y)) => {
            x == y
                || (x.is_nan() && y.is_nan())
                || (x.is_finite() && y.is_finite() && (x - y).abs() <= rtol * x.abs().max(y.abs()))
        }
        _ => a == b,
    }
}

fn equal(a: &J, b: &J, rtol: f64) -> bool {
    match (a, b) {
        (J::Null, J::Null) => true,
        (J::Bool(x), J::Bool(y)) => x == y,
        (J::Num(x), J::Num(y)) => num_equal(x, y, rtol),
        (J::Str(x), J::Str(y)) => x == y,
        (J::Arr(x), J::Arr(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| equal(p, q, rtol))
        }
        (J::Obj(x), J::Obj(y)) => {
            if x.len() != y.len() {
                return false;
            }
            let mut xs: Vec<_> = x.iter().collect();
            let mut ys: Vec<_> = y.iter().collect();
            xs.sort_by(|p, q| p.0.cmp(&q.0));
            ys.sort_by(|p, q| p.0.cmp(&q.0));
            xs.iter()
                .zip(&ys)
                .all(|(p, q)| p.0 == q.0 && equal(&p.1, &q.1, rtol))
        }
        _ => false,
    }
}

pub(crate) fn check_json(
    what: impl FnOnce() -> String,
    text: &str,
    object: bool,
) -> Result<String> {
    let text = text.trim();
    if text.is_empty() {
        return Ok("{}".into());
    }
    match parse(text) {
        Some(J::Obj(_)) => Ok(text.to_string()),
        Some(_) if !object => Ok(text.to_string()),
        Some(_) => Err(Error::invalid(what(), "must be a JSON object")),
        None => Err(Error::invalid(
            what(),
            format!("not valid JSON: {text:.80}"),
        )),
    }
}

/// `text` without the whitespace outside strings: `{"a": [1, 2]}` becomes
/// `{"a":[1,2]}`.
pub fn compact(text: &str) -> String {
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
pub fn pretty(text: &str) -> String {
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
pub fn members(text: &str) -> Option<Vec<(String, String)>> {
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
pub fn string(s: &str) -> String {
    // Serializing a &str cannot fail.
    serde_json::to_string(s).unwrap_or_default()
}

/// Builds the text of a JSON object whose members are JSON texts.
#[derive(Debug)]
pub struct Object(String);

impl Default for Object {
    fn default() -> Self {
        Object(String::from("{"))
    }
}

impl Object {
    pub fn new() -> Self {
        Object::default()
    }

    /// Add a member whose value is JSON text, written as given.
    pub fn raw(&mut self, key: &str, json: &str) -> &mut Self {
        if self.0.len() > 1 {
            self.0.push(',');
        }
        let _ = write!(self.0, "{}:{json}", string(key));
        self
    }

    /// Add a member holding a `serde_json` value.
    pub fn value(&mut self, key: &str, value: &serde_json::Value) -> &mut Self {
        // Serializing a `Value` cannot fail.
        self.raw(key, &serde_json::to_string(value).unwrap_or_default())
    }

    pub fn finish(&mut self) -> String {
        let mut text = std::mem::take(&mut self.0);
        text.push('}');
        text
    }
}

/// The text of a JSON array of JSON texts.
pub fn array(items: &[String]) -> String {
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
