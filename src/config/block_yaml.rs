//! A fast path for the YAML that tables are written in: block mappings and sequences whose
//! scalars and flow collections each fit on one line, with comments. Such a document is
//! turned into JSON text, which serde_json decodes several times faster than the full YAML
//! parser (a 10,000-route table is parsed, validated and indexed in 41 ms this way, 154 ms
//! through serde-saphyr).
//!
//! Anything outside that subset returns `None`, and the caller takes the full parser, which
//! is also the one that reports errors: anchors, aliases, tags, block and multi-line
//! scalars, escapes, tabs, carriage returns (so CRLF files too), non-ASCII text, document
//! markers, merge keys, complex keys, duplicate keys, plain keys that may not read as
//! strings (`0`, `yes`), trailing commas, deep nesting. Nothing is ever guessed.
//!
//! Scalars other than the null forms become JSON strings holding their text, which is what
//! the full parser hands a string field. A field of another type fails to decode from such a
//! string, and that too sends the document to the full parser; so the JSON is only ever
//! decoded into a typed struct, never used as a generic document (where `1` is a number).
//! This module never reads files.

use std::borrow::Cow;

/// Deepest nesting of containers (block and flow together) the fast path takes.
const MAX_DEPTH: usize = 64;

/// Longest key, from its first character to its colon: YAML allows 1,024 characters for
/// a key written without `?`.
const MAX_KEY: usize = 1000;

/// Most keys checked for duplicates in one mapping; a larger mapping goes to the full parser.
const MAX_KEYS: usize = 64;

/// The document as JSON text, or `None` if it is not in the subset this module reads.
pub fn to_json(text: &str) -> Option<String> {
    // Control characters (but the line feed) and non-ASCII text: the full parser knows
    // which of them YAML allows where.
    if text.bytes().any(|b| (b < 0x20 && b != b'\n') || b >= 0x7f) {
        return None;
    }
    let mut w = Writer {
        out: String::with_capacity(text.len() + text.len() / 4),
        stack: Vec::new(),
        keys: Vec::new(),
        pending: None,
    };
    for line in text.split('\n') {
        w.line(line)?;
    }
    w.finish()
}

/// An open block container.
struct Frame {
    /// A sequence (`- item` lines), else a mapping (`key: value` lines).
    seq: bool,
    /// Column of its `-` or of its keys.
    indent: usize,
    /// Entries written so far (for commas).
    count: usize,
    /// Where its keys start in [`Writer::keys`].
    keys_from: usize,
}

struct Writer<'a> {
    out: String,
    stack: Vec<Frame>,
    /// The keys of every open mapping, block and flow, for the duplicate check.
    keys: Vec<Cow<'a, str>>,
    /// The indent of the mapping whose last key still waits for its value (`key:` at the
    /// end of a line): a deeper block on the next lines, or null.
    pending: Option<usize>,
}

/// `- ` starts a sequence entry (a lone `-` is an empty entry, which the fast path leaves
/// to the full parser).
fn is_entry(content: &str) -> bool {
    content.starts_with("- ") || content == "-"
}

/// The core schema's null forms.
fn is_null(plain: &str) -> bool {
    matches!(plain, "null" | "Null" | "NULL" | "~")
}

/// A plain key that the YAML parser can only read as a string: it compares keys by value
/// for its duplicate check (`0` and `0o0` are the same key), so keys that may read as a
/// number, boolean or null are left to it.
fn string_key(plain: &str) -> bool {
    plain.starts_with(|c: char| c.is_ascii_alphabetic())
        && ![
            "true", "false", "yes", "no", "on", "off", "y", "n", "null", "inf", "nan",
        ]
        .iter()
        .any(|w| plain.eq_ignore_ascii_case(w))
}

/// Only spaces and a comment are left on the line. A comment needs a space before it.
fn is_line_end(rest: &str) -> bool {
    let t = rest.trim_start_matches(' ');
    t.is_empty() || (t.starts_with('#') && t.len() < rest.len())
}

/// Whether a plain scalar may start with `s` (in flow context `flow` is true): not with an
/// indicator, and `-`, `?`, `:` only when followed by a character that is part of it.
fn plain_start(s: &str, flow: bool) -> bool {
    let b = s.as_bytes();
    match b.first() {
        None => false,
        Some(b'-' | b'?' | b':') => match b.get(1) {
            None | Some(b' ') => false,
            Some(b',' | b'[' | b']' | b'{' | b'}') => !flow,
            Some(_) => true,
        },
        Some(
            b',' | b'[' | b']' | b'{' | b'}' | b'#' | b'&' | b'*' | b'!' | b'|' | b'>' | b'\''
            | b'"' | b'%' | b'@' | b'`' | b' ',
        ) => false,
        Some(_) => true,
    }
}

/// A quoted scalar at the start of `s` and the text after it. Escapes and scalars that go
/// on past the line are left to the full parser.
fn quoted(s: &str) -> Option<(Cow<'_, str>, &str)> {
    let body = &s[1..];
    if s.starts_with('"') {
        let end = body.find(['"', '\\'])?;
        if body.as_bytes()[end] == b'\\' {
            return None;
        }
        return Some((Cow::Borrowed(&body[..end]), &body[end + 1..]));
    }
    // Single quotes: `''` is a quote.
    let mut owned: Option<String> = None;
    let mut from = 0;
    loop {
        let end = from + body[from..].find('\'')?;
        if body.as_bytes().get(end + 1) == Some(&b'\'') {
            owned
                .get_or_insert_with(String::new)
                .push_str(&body[from..=end]);
            from = end + 2;
            continue;
        }
        let text = match owned {
            Some(mut o) => {
                o.push_str(&body[from..end]);
                Cow::Owned(o)
            }
            None => Cow::Borrowed(&body[..end]),
        };
        return Some((text, &body[end + 1..]));
    }
}

/// After a quoted key: the text after its colon, which must be followed by a space or the
/// end of the line.
fn key_colon(rest: &str) -> Option<&str> {
    let rest = rest.trim_start_matches(' ').strip_prefix(':')?;
    (rest.is_empty() || rest.starts_with(' ')).then_some(rest)
}

/// A plain scalar in block context at the start of `s`, if it is a key (`key:` followed by
/// a space or the end of the line): the key and the text after the colon.
fn block_key(s: &str) -> Option<(&str, &str)> {
    let b = s.as_bytes();
    for i in 0..b.len() {
        match b[i] {
            b':' if b.get(i + 1).is_none_or(|&c| c == b' ') => {
                return Some((s[..i].trim_end_matches(' '), &s[i + 1..]));
            }
            b'#' if i > 0 && b[i - 1] == b' ' => return None,
            _ => {}
        }
    }
    None
}

impl<'a> Writer<'a> {
    fn line(&mut self, line: &'a str) -> Option<()> {
        let content = line.trim_start_matches(' ');
        if content.is_empty() || content.starts_with('#') {
            return Some(());
        }
        let indent = line.len() - content.len();
        if indent == 0 && (content.starts_with("---") || content.starts_with("...")) {
            return None;
        }
        if self.stack.is_empty() {
            // The document is a block mapping starting in the first column.
            if indent != 0 || !self.out.is_empty() {
                return None;
            }
            self.open(false, 0)?;
        }
        if let Some(key_indent) = self.pending.take() {
            if indent > key_indent || (indent == key_indent && is_entry(content)) {
                // The value is a block starting on this line; a sequence may sit at the
                // key's own indent.
                self.open(is_entry(content), indent)?;
            } else {
                self.out.push_str("null");
            }
        }
        while let Some(top) = self.stack.last() {
            // A sequence at its mapping's indent ends at the first line that is not an entry.
            if top.indent > indent || (top.seq && top.indent == indent && !is_entry(content)) {
                self.close();
            } else {
                break;
            }
        }
        let top = self.stack.last()?;
        if top.indent != indent {
            // Deeper than the open container with no key waiting: a scalar going on past
            // its line, or bad indentation.
            return None;
        }
        if !top.seq {
            return self.entry(content, indent);
        }
        let after = content[1..].trim_start_matches(' ');
        if after.is_empty() || after.starts_with('#') || is_entry(after) {
            return None;
        }
        self.comma();
        let column = indent + content.len() - after.len();
        let is_key = match after.as_bytes()[0] {
            b'"' | b'\'' => key_colon(quoted(after)?.1).is_some(),
            b'[' | b'{' => false,
            _ => block_key(after).is_some(),
        };
        if is_key {
            // `- key: value`: a mapping whose keys sit in this column.
            self.open(false, column)?;
            self.entry(after, column)
        } else {
            self.value(after)
        }
    }

    /// A `key: value` line of the mapping at `indent`.
    fn entry(&mut self, content: &'a str, indent: usize) -> Option<()> {
        let (key, rest): (Cow<'a, str>, &'a str) = match content.as_bytes()[0] {
            b'"' | b'\'' => {
                let (key, rest) = quoted(content)?;
                (key, key_colon(rest)?)
            }
            _ => {
                if !plain_start(content, false) {
                    return None;
                }
                let (key, rest) = block_key(content)?;
                if !string_key(key) {
                    return None;
                }
                (Cow::Borrowed(key), rest)
            }
        };
        if content.len() - rest.len() > MAX_KEY {
            return None;
        }
        self.comma();
        self.key(key, self.stack.last()?.keys_from)?;
        if is_line_end(rest) {
            self.pending = Some(indent);
            return Some(());
        }
        self.value(rest.trim_start_matches(' '))
    }

    /// A value in block context that must end its line.
    fn value(&mut self, s: &'a str) -> Option<()> {
        let rest = match s.as_bytes()[0] {
            b'[' | b'{' => self.flow(s, self.stack.len())?,
            b'"' | b'\'' => {
                let (text, rest) = quoted(s)?;
                string(&mut self.out, &text);
                rest
            }
            _ => {
                if !plain_start(s, false) {
                    return None;
                }
                let end = s.find(" #").unwrap_or(s.len());
                let text = s[..end].trim_end_matches(' ');
                // `a: b: c` is an error; `a: b:` too.
                if text.contains(": ") || text.ends_with(':') {
                    return None;
                }
                self.scalar(text);
                ""
            }
        };
        is_line_end(rest).then_some(())
    }

    /// A flow collection at the start of `s`, on one line; the text after it.
    fn flow(&mut self, s: &'a str, depth: usize) -> Option<&'a str> {
        if depth >= MAX_DEPTH {
            return None;
        }
        let map = s.starts_with('{');
        let close = if map { b'}' } else { b']' };
        self.out.push(if map { '{' } else { '[' });
        let keys_from = self.keys.len();
        let mut s = s[1..].trim_start_matches(' ');
        if s.as_bytes().first() == Some(&close) {
            self.out.push(close as char);
            return Some(&s[1..]);
        }
        loop {
            if map {
                let (key, rest) = self.flow_scalar(s)?;
                // `{a}` and `{a:b}` are left to the full parser.
                let value = rest.trim_start_matches(' ').strip_prefix(": ")?;
                if s.len() - value.len() > MAX_KEY {
                    return None;
                }
                s = value.trim_start_matches(' ');
                self.flow_key(key, keys_from)?;
                s = self.flow_value(s, depth)?;
            } else {
                s = self.flow_value(s, depth)?;
                if s.trim_start_matches(' ').starts_with(':') {
                    // `[a: b]` is a mapping inside the sequence.
                    return None;
                }
            }
            s = s.trim_start_matches(' ');
            match s.as_bytes().first() {
                Some(b',') => {
                    s = s[1..].trim_start_matches(' ');
                    if matches!(s.as_bytes().first(), Some(b']' | b'}')) {
                        // A trailing comma.
                        return None;
                    }
                    self.out.push(',');
                }
                Some(&c) if c == close => {
                    self.keys.truncate(keys_from);
                    self.out.push(close as char);
                    return Some(&s[1..]);
                }
                _ => return None,
            }
        }
    }

    /// A value inside a flow collection; the text after it.
    fn flow_value(&mut self, s: &'a str, depth: usize) -> Option<&'a str> {
        if matches!(s.as_bytes().first(), Some(b'[' | b'{')) {
            return self.flow(s, depth + 1);
        }
        let (text, rest) = self.flow_scalar(s)?;
        match text {
            Scalar::Plain(p) => self.scalar(p),
            Scalar::Quoted(q) => string(&mut self.out, &q),
        }
        Some(rest)
    }

    /// A quoted or plain scalar inside a flow collection; the text after it.
    fn flow_scalar(&mut self, s: &'a str) -> Option<(Scalar<'a>, &'a str)> {
        match s.as_bytes().first()? {
            b'"' | b'\'' => {
                let (text, rest) = quoted(s)?;
                Some((Scalar::Quoted(text), rest))
            }
            _ => {
                if !plain_start(s, true) {
                    return None;
                }
                let b = s.as_bytes();
                let mut end = b.len();
                for i in 0..b.len() {
                    match b[i] {
                        b',' | b']' | b'}' => {
                            end = i;
                            break;
                        }
                        b':' if matches!(
                            b.get(i + 1),
                            None | Some(b' ' | b',' | b'[' | b']' | b'{' | b'}')
                        ) =>
                        {
                            end = i;
                            break;
                        }
                        // A comment or a nested collection inside a plain scalar: the
                        // collection does not end on this line, or is an error. (`i` is not
                        // 0 here: a plain scalar does not start with `#`.)
                        b'#' if b[i - 1] == b' ' => return None,
                        b'[' | b'{' => return None,
                        _ => {}
                    }
                }
                if end == b.len() {
                    // The collection goes on past the line.
                    return None;
                }
                Some((Scalar::Plain(s[..end].trim_end_matches(' ')), &s[end..]))
            }
        }
    }

    fn flow_key(&mut self, key: Scalar<'a>, keys_from: usize) -> Option<()> {
        let key = match key {
            Scalar::Plain(p) if !string_key(p) => return None,
            Scalar::Plain(p) => Cow::Borrowed(p),
            Scalar::Quoted(q) => q,
        };
        self.key(key, keys_from)
    }

    /// Writes a key new to its mapping (whose keys start at `from`), and its colon.
    fn key(&mut self, key: Cow<'a, str>, from: usize) -> Option<()> {
        self.check_key(&key, from)?;
        string(&mut self.out, &key);
        self.keys.push(key);
        self.out.push(':');
        Some(())
    }

    /// A key not seen before in its mapping (whose keys start at `from`).
    fn check_key(&self, key: &str, from: usize) -> Option<()> {
        let seen = &self.keys[from..];
        (seen.len() < MAX_KEYS && seen.iter().all(|k| k != key)).then_some(())
    }

    fn scalar(&mut self, plain: &str) {
        if is_null(plain) {
            self.out.push_str("null");
        } else {
            string(&mut self.out, plain);
        }
    }

    fn comma(&mut self) {
        if let Some(top) = self.stack.last_mut() {
            if top.count > 0 {
                self.out.push(',');
            }
            top.count += 1;
        }
    }

    fn open(&mut self, seq: bool, indent: usize) -> Option<()> {
        if self.stack.len() >= MAX_DEPTH {
            return None;
        }
        self.out.push(if seq { '[' } else { '{' });
        self.stack.push(Frame {
            seq,
            indent,
            count: 0,
            keys_from: self.keys.len(),
        });
        Some(())
    }

    fn close(&mut self) {
        if let Some(top) = self.stack.pop() {
            self.keys.truncate(top.keys_from);
            self.out.push(if top.seq { ']' } else { '}' });
        }
    }

    fn finish(mut self) -> Option<String> {
        if self.stack.is_empty() {
            return None;
        }
        if self.pending.take().is_some() {
            self.out.push_str("null");
        }
        while !self.stack.is_empty() {
            self.close();
        }
        Some(self.out)
    }
}

enum Scalar<'a> {
    Plain(&'a str),
    Quoted(Cow<'a, str>),
}

/// Writes `s` as a JSON string (control characters were turned away up front).
fn string(out: &mut String, s: &str) {
    out.push('"');
    if s.contains(['"', '\\']) {
        for c in s.chars() {
            if matches!(c, '"' | '\\') {
                out.push('\\');
            }
            out.push(c);
        }
    } else {
        out.push_str(s);
    }
    out.push('"');
}

/// The fast path's contract, checked against the YAML parser (for tests and the fuzz
/// target): when it takes a document, the YAML parser reads the same structure from it,
/// and a routing table decoded from the JSON is the one trellis decodes without the fast
/// path. `None`:
/// not taken; `Some(decoded)`: taken, and whether a routing table decoded from it.
#[doc(hidden)]
pub fn check_against_yaml_parser(doc: &str) -> Result<Option<bool>, String> {
    use super::routes::RawRoutingTable;
    use serde_json::Value;
    let Some(json) = to_json(doc) else {
        return Ok(None);
    };
    let mine: Value =
        serde_json::from_str(&json).map_err(|e| format!("invalid JSON ({e}): {json}"))?;
    let theirs: Value = serde_saphyr::from_str_with_options(doc, super::yaml_options())
        .map_err(|e| format!("took YAML the parser rejects:\n{doc}\n--- {e}\n--- {json}"))?;
    if !same_shape(&mine, &theirs) {
        return Err(format!(
            "different documents:\n{doc}\n--- fast: {mine}\n--- full: {theirs}"
        ));
    }
    let Ok(table) = serde_json::from_value::<RawRoutingTable>(mine) else {
        return Ok(Some(false));
    };
    // What trellis decodes without the fast path: the YAML parser's typed path, else its
    // generic document.
    let full =
        match serde_saphyr::from_str_with_options::<RawRoutingTable>(doc, super::yaml_options()) {
            Ok(t) => t,
            Err(_) => super::decode::<RawRoutingTable>(std::path::Path::new("table"), theirs)
                .map_err(|e| format!("table the slow path rejects:\n{doc}\n--- {e}"))?,
        };
    if full == table {
        Ok(Some(true))
    } else {
        Err(format!(
            "different tables:\n{doc}\n--- fast: {table:?}\n--- full: {full:?}"
        ))
    }
}

/// `mine` has the YAML parser's shape, and the same text wherever the YAML parser kept text
/// (it turns `1` and `true` into a number and a boolean).
fn same_shape(mine: &serde_json::Value, theirs: &serde_json::Value) -> bool {
    use serde_json::Value;
    match (mine, theirs) {
        (Value::Object(a), Value::Object(b)) => {
            a.len() == b.len()
                && a.iter()
                    .all(|(k, v)| b.get(k).is_some_and(|w| same_shape(v, w)))
        }
        (Value::Array(a), Value::Array(b)) => {
            a.len() == b.len() && a.iter().zip(b).all(|(v, w)| same_shape(v, w))
        }
        (Value::Null, Value::Null) => true,
        (Value::String(a), Value::String(b)) => {
            // The parser spells non-finite floats its own way (`.INF` and `9e999` are
            // `.inf`).
            a == b
                || matches!(b.as_str(), ".inf" | "-.inf" | ".nan")
                    && (a.to_ascii_lowercase().trim_start_matches('+') == *b
                        || a.parse::<f64>().is_ok_and(|f| !f.is_finite()))
        }
        (Value::String(_), Value::Number(_) | Value::Bool(_)) => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HEAD: &str = "apiVersion: trellis.gardener.cloud/v1alpha1\nkind: RoutingTable\n";

    #[test]
    fn tables_decode_as_the_yaml_parser_decodes_them() {
        for body in [
            // The layout of the SPEC's example and the benches' tables.
            "routes:\n- name: shoot--dev--alpha\n  sni: [api.alpha.dev.internal.example.com, \"*.alpha.example.com\"]\n  destinations: [\"outbound|443||kube-apiserver.shoot--dev--alpha.svc.cluster.local\"]\n  proxyDestinations: [\"240.168.102.23:443\"]\n  backends:\n  - {address: \"10.1.2.3:443\", zone: eu-1a}\n  - address: \"kube-apiserver.shoot--dev--alpha.svc.cluster.local:443\"\n  timeouts: {connect: 5s, idle: 1h}\n  maxConnectionDuration: 24h\n",
            // Indented sequences, block lists, comments, blank lines, both quotes.
            "# a comment\nroutes:   # the routes\n\n  - name: 'it''s'\n    sni:\n      - a.example.com   # first\n      - 'b.example.com'\n    backends:\n\n      - address: 10.0.0.1:443\n        zone: ~\n      - {address: \"h:1\", zone: null}\n  -   name: b\n      backends: [{address: x:1}, {'address': 'y:2', \"zone\": 'z #1'}]\n",
            // Text that looks like other types stays text; `#` without a space is text.
            "routes:\n- name: \"123\"\n  sni: [a#b.example.com]\n  destinations: [a:b, 'x: y', \"[z]\", -q, a b c]\n  backends: [{address: 'a\"b:1', zone: true}]\n  timeouts:\n    idle: 10s\n",
            "routes: []\n",
        ] {
            let doc = format!("{HEAD}{body}");
            assert_eq!(check_against_yaml_parser(&doc), Ok(Some(true)), "{doc}");
        }
        // Found by the fuzz target: a list where a mapping is expected, which serde's
        // derived structs would read field by field; the JSON decode refuses it (the other
        // paths are covered by config::tests::a_sequence_is_never_read_as_a_mapping).
        let list = format!(
            "{HEAD}routes:\n- name: a\n  backends: [{{address: \"a:1\"}}]\n  timeouts:\n  - 1h\n"
        );
        assert_eq!(check_against_yaml_parser(&list), Ok(Some(false)));
        // Found by the fuzz target: the parser's generic documents turn these into
        // non-finite floats, which a string field keeps as text.
        let floats = format!("{HEAD}routes: []\na: .INF\nb: 8888e8888\n");
        assert_eq!(check_against_yaml_parser(&floats), Ok(Some(false)));
        // Taken, but null is not a list: the table is then left to the YAML parser, which
        // rejects it too.
        let null = format!("{HEAD}routes:\n");
        assert_eq!(check_against_yaml_parser(&null), Ok(Some(false)));
    }

    #[test]
    fn everything_else_is_left_to_the_yaml_parser() {
        for body in [
            "routes: &r []\n",
            "a: &x b\nroutes: *x\n",
            "routes: !!seq []\n",
            "routes:\n- name: |\n    a\n",
            "routes:\n- name: >\n    a\n",
            "routes:\n- name: a\n    b\n",
            "routes:\n- name: \"a\n    b\"\n",
            "routes:\n- name: \"a\\tb\"\n",
            "routes:\n- name:\ta\n",
            "routes:\r\n- name: a\r\n",
            "routes:\n- name: \u{e9}\n",
            "---\nroutes: []\n",
            "routes: []\n...\n",
            "<<: {a: b}\nroutes: []\n",
            "? routes\n: []\n",
            "routes: []\nroutes: []\n",
            "routes: []\n'routes': []\n",
            "routes: [{name: a, name: b}]\n",
            "routes: [a, b,]\n",
            "routes: [a,\n  b]\n",
            "routes: [a: b]\n",
            "routes: [{a}]\n",
            "routes: [{a:b}]\n",
            "routes:\n- - a\n",
            "routes:\n-\n  name: a\n",
            "routes: a: b\n",
            "routes: a:\n",
            "routes: - a\n",
            "routes:\n  - a\n b: c\n",
            "  routes: []\n",
            "- routes\n",
            "routes: \"a\"b\n",
            "routes: \"a\"#b\n",
            "routes: [a #b]\n",
            "routes: ['a''\n",
            "null: a\n",
            "routes: []\n0: a\n0o0: b\n",
            "routes: []\nyes: a\n",
            &format!("routes: []\n'{}': a\n", "k".repeat(1100)),
            &format!("routes: [{{'{}': a}}]\n", "k".repeat(1100)),
            "routes: [{1: a}]\n",
            "",
            "# only a comment\n",
        ] {
            let doc = if body.starts_with("apiVersion") || body.is_empty() || body.starts_with('#')
            {
                body.to_owned()
            } else {
                format!("{HEAD}{body}")
            };
            assert_eq!(to_json(&doc), None, "taken:\n{doc}");
        }
        // Nesting deeper than the limit.
        let deep = format!("{HEAD}routes: {}{}\n", "[".repeat(70), "]".repeat(70));
        assert_eq!(to_json(&deep), None);
    }

    /// A small deterministic generator (no test-only crates for this).
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
        fn pick<'s>(&mut self, from: &[&'s str]) -> &'s str {
            from[self.below(from.len())]
        }
    }

    /// A scalar written in one of the styles the fast path reads.
    fn scalar(rng: &mut Rng, text: &str) -> String {
        let plain_ok = plain_start(text, true)
            && !text.contains([',', '[', ']', '{', '}', '#', ':'])
            && text.trim() == text;
        match rng.below(3) {
            0 if plain_ok => text.to_owned(),
            1 if !text.contains(['"', '\\']) => format!("\"{text}\""),
            _ => format!("'{}'", text.replace('\'', "''")),
        }
    }

    const TEXTS: &[&str] = &[
        "a.example.com",
        "*.b.example.com",
        "10.0.0.1:443",
        "h:1",
        "it's",
        "q\"uote",
        "x y",
        "-dash",
        "a#b",
        "123",
        "true",
        "null",
        "~",
        "",
        " pad ",
        "a: b",
        "[x]",
        "{y}",
        "b\\s",
        "eu-1a",
        "24h",
        "5s",
    ];

    /// A random routing-table-shaped document in the subset, in random styles.
    fn document(rng: &mut Rng) -> String {
        let ind = |n: usize| " ".repeat(n);
        let mut out = String::new();
        if rng.below(3) == 0 {
            out += "# generated\n";
        }
        out += &format!(
            "apiVersion: {}\n",
            scalar(rng, "trellis.gardener.cloud/v1alpha1")
        );
        out += "kind: RoutingTable\n";
        let seq_indent = rng.pick(&["", "  ", "    "]).len();
        out += "routes:\n";
        for _ in 0..rng.below(4) {
            let item = seq_indent + 2 + rng.below(2);
            let lead = format!("{}-{}", ind(seq_indent), ind(item - seq_indent - 1));
            let mut first = true;
            let mut field = |out: &mut String, line: String| {
                if first {
                    *out += &format!("{lead}{line}\n");
                    first = false;
                } else {
                    *out += &format!("{}{line}\n", ind(item));
                }
            };
            let name = rng.pick(TEXTS);
            field(&mut out, format!("name: {}", scalar(rng, name)));
            for key in ["sni", "destinations", "proxyDestinations"] {
                if rng.below(2) == 0 {
                    continue;
                }
                let values: Vec<String> = (0..rng.below(3))
                    .map(|_| {
                        let t = rng.pick(TEXTS);
                        scalar(rng, t)
                    })
                    .collect();
                if rng.below(2) == 0 {
                    field(&mut out, format!("{key}: [{}]", values.join(", ")));
                } else if values.is_empty() {
                    field(&mut out, format!("{key}: []"));
                } else {
                    field(&mut out, format!("{key}:"));
                    let at = item + rng.below(3);
                    for v in values {
                        out += &format!("{}- {v}{}\n", ind(at), rng.pick(&["", " # c", "  "]));
                    }
                }
            }
            field(&mut out, "backends:".to_owned());
            let at = item + rng.below(3);
            for _ in 0..1 + rng.below(2) {
                let address = {
                    let t = rng.pick(TEXTS);
                    scalar(rng, t)
                };
                let zone = match rng.below(4) {
                    0 => None,
                    1 => Some("~".to_owned()),
                    _ => Some({
                        let t = rng.pick(TEXTS);
                        scalar(rng, t)
                    }),
                };
                if rng.below(2) == 0 {
                    let zone = zone.map(|z| format!(", zone: {z}")).unwrap_or_default();
                    out += &format!("{}- {{address: {address}{zone}}}\n", ind(at));
                } else {
                    out += &format!("{}- address: {address}\n", ind(at));
                    if let Some(z) = zone {
                        out += &format!("{}  zone: {z}\n", ind(at));
                    }
                }
            }
            if rng.below(3) == 0 {
                field(&mut out, "timeouts:".to_owned());
                out += &format!("{}idle: {}\n", ind(item + 2), scalar(rng, "1h"));
            }
            if rng.below(4) == 0 {
                out += "\n# between routes\n";
            }
        }
        out
    }

    #[test]
    fn generated_and_mutated_documents_agree_with_the_yaml_parser() {
        const MUTATIONS: &[u8] = b" :#-\"'[]{},\n*&!|>~?a\\";
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let (mut taken, mut mutants_taken) = (0, 0);
        for _ in 0..400 {
            let doc = document(&mut rng);
            // Every generated document is in the subset: the property is exercised.
            match check_against_yaml_parser(&doc) {
                Ok(Some(decoded)) => taken += usize::from(decoded),
                other => panic!("{other:?}:\n{doc}"),
            }
            for _ in 0..20 {
                let mut bytes = doc.clone().into_bytes();
                for _ in 0..1 + rng.below(3) {
                    let at = rng.below(bytes.len() + 1);
                    let c = MUTATIONS[rng.below(MUTATIONS.len())];
                    match rng.below(3) {
                        0 if at < bytes.len() => {
                            bytes.remove(at);
                        }
                        1 if at < bytes.len() => bytes[at] = c,
                        _ => bytes.insert(at, c),
                    }
                }
                let mutant = String::from_utf8(bytes).unwrap();
                match check_against_yaml_parser(&mutant) {
                    Ok(Some(_)) => mutants_taken += 1,
                    Ok(None) => {}
                    Err(e) => panic!("{e}"),
                }
            }
        }
        // Tables that decode are common, and so are mutants the fast path still reads.
        assert!(taken > 50, "{taken}");
        assert!(mutants_taken > 1000, "{mutants_taken}");
        eprintln!("taken {taken} mutants {mutants_taken}");
    }
}
