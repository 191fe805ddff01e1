//! Where a field path is in a file: the line and column of the key or value it names, for
//! the problems found after the parser was done with them (unknown fields, validation).
//!
//! The text is read again as a stream of YAML events (JSON is YAML too), keeping the paths
//! of the mappings and sequences that lead to a wanted path and skipping every other
//! subtree. A path the file does not have (a required field left out, a value inside an
//! alias) gets the position of the nearest value around it that the file has. Only a file
//! with problems is read again; one the parser cannot read keeps its problems unpositioned.
//! This module never opens files and never changes a message.

use std::collections::{HashMap, HashSet};

use serde_saphyr::granit_parser::{Event, Parser};

use super::error::FieldError;

/// Which end of a mapping entry a problem is pointed at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Anchor {
    /// The key: the field itself is the problem (an unknown field).
    Key,
    /// The value: what is written there is the problem.
    Value,
}

/// Line and column (from 1) of an entry's key and of its value; a sequence element's key is
/// its value.
#[derive(Debug, Clone, Copy)]
struct Entry {
    key: (u64, u64),
    value: (u64, u64),
}

/// Gives each of `errors` that has a field path but no position the position of that path
/// in `text` (or of the nearest value around it).
pub(super) fn locate(text: &str, errors: &mut [FieldError], anchor: Anchor) {
    let open = |e: &FieldError| e.position.is_none() && !e.path.is_empty();
    let mut wanted: HashSet<&str> = HashSet::from([""]);
    for e in errors.iter().filter(|e| open(e)) {
        wanted.extend(prefixes(&e.path));
    }
    if wanted.len() == 1 {
        return;
    }
    let found = entries(text, &wanted);
    for e in errors.iter_mut().filter(|e| open(e)) {
        let nearest = prefixes(&e.path).rev().find_map(|p| found.get(p));
        e.position = nearest.map(|entry| match anchor {
            Anchor::Key => entry.key,
            Anchor::Value => entry.value,
        });
    }
}

/// `a`, `a.b`, `a.b[3]`, `a.b[3].c` for `a.b[3].c`: the path and every path around it.
fn prefixes(path: &str) -> impl DoubleEndedIterator<Item = &str> {
    let ends: Vec<usize> = path
        .char_indices()
        .filter(|&(i, c)| i > 0 && (c == '.' || c == '['))
        .map(|(i, _)| i)
        .chain([path.len()])
        .collect();
    ends.into_iter().map(move |end| &path[..end])
}

/// What a collection being read is.
enum Frame {
    /// A mapping at `path`; `key` is the key whose value comes next, with its position.
    Mapping {
        path: String,
        key: Option<(String, (u64, u64))>,
    },
    /// A sequence at `path`; `index` is the next element's.
    Sequence { path: String, index: usize },
}

/// The entries of the first document at the `wanted` paths.
fn entries(text: &str, wanted: &HashSet<&str>) -> HashMap<String, Entry> {
    let mut found = HashMap::new();
    let mut stack: Vec<Frame> = Vec::new();
    // Depth inside a subtree no wanted path goes through (or a mapping key that is itself a
    // collection): its nodes are not looked at.
    let mut skipping = 0usize;
    for event in Parser::new_from_str(text) {
        let Ok((event, span)) = event else {
            break;
        };
        let position = (span.start.line() as u64, span.start.col() as u64 + 1);
        let collection = match event {
            Event::MappingStart(..) => Some(true),
            Event::SequenceStart(..) => Some(false),
            Event::Scalar(..) | Event::Alias(..) | Event::UnresolvedAlias(..) => None,
            Event::MappingEnd | Event::SequenceEnd => {
                if skipping > 0 {
                    skipping -= 1;
                } else {
                    stack.pop();
                }
                continue;
            }
            Event::DocumentEnd => break,
            _ => continue,
        };
        if skipping > 0 {
            skipping += usize::from(collection.is_some());
            continue;
        }
        let (path, key) = match stack.last_mut() {
            None => (String::new(), position),
            Some(Frame::Mapping { path, key }) => match key.take() {
                // This node is a key.
                None => {
                    let text = match &event {
                        Event::Scalar(text, ..) => text.to_string(),
                        _ => String::new(),
                    };
                    *key = Some((text, position));
                    skipping = usize::from(collection.is_some());
                    continue;
                }
                Some((key, at)) if path.is_empty() => (key, at),
                Some((key, at)) => (format!("{path}.{key}"), at),
            },
            Some(Frame::Sequence { path, index }) => {
                let path = format!("{path}[{index}]");
                *index += 1;
                (path, position)
            }
        };
        let is_wanted = wanted.contains(path.as_str());
        if is_wanted {
            found.insert(
                path.clone(),
                Entry {
                    key,
                    value: position,
                },
            );
        }
        match collection {
            Some(_) if !is_wanted => skipping = 1,
            Some(true) => stack.push(Frame::Mapping { path, key: None }),
            Some(false) => stack.push(Frame::Sequence { path, index: 0 }),
            None => {}
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(text: &str, paths: &[&str], anchor: Anchor) -> Vec<Option<(u64, u64)>> {
        let mut errors: Vec<FieldError> = paths
            .iter()
            .map(|p| FieldError {
                path: (*p).into(),
                message: "m".into(),
                position: None,
            })
            .collect();
        locate(text, &mut errors, anchor);
        errors.into_iter().map(|e| e.position).collect()
    }

    #[test]
    fn paths_are_found_in_block_flow_and_json() {
        let yaml = "kind: RoutingTable\nroutes:\n- name: a\n  backends:\n  - {address: x}\n- name: b\n  backends: [{address: \"y\", zone: z}]\n";
        assert_eq!(
            at(
                yaml,
                &[
                    "routes[0].backends[0].address",
                    "routes[1].backends[0].address",
                    "routes[1].name",
                    "kind",
                ],
                Anchor::Value
            ),
            [Some((5, 15)), Some((7, 24)), Some((6, 9)), Some((1, 7))]
        );
        // The key of an entry whose value is on the next lines.
        assert_eq!(
            at(yaml, &["routes[0].backends"], Anchor::Key),
            [Some((4, 3))]
        );
        let json =
            "{\"kind\": \"RoutingTable\",\n \"routes\": [{\"name\": \"a\", \"bakends\": []}]}";
        assert_eq!(
            at(json, &["routes[0].bakends", "routes[0].name"], Anchor::Key),
            [Some((2, 27)), Some((2, 14))]
        );
    }

    /// A path the file does not have points at the nearest value around it; a problem with
    /// a position already, or about the whole document, is left as it is.
    #[test]
    fn a_missing_path_points_at_what_holds_it() {
        let yaml = "listeners:\n- name: a\n  protocol: wireguard\n";
        assert_eq!(
            at(
                yaml,
                &["listeners[0].wireguard", "listeners[3].name", ""],
                Anchor::Value
            ),
            [Some((2, 3)), Some((2, 3)), None]
        );
        let mut errors = vec![FieldError {
            path: "listeners".into(),
            message: "m".into(),
            position: Some((9, 9)),
        }];
        locate(yaml, &mut errors, Anchor::Value);
        assert_eq!(errors[0].position, Some((9, 9)));
    }

    #[test]
    fn prefixes_of_a_path() {
        assert_eq!(
            prefixes("a.b[3].c").collect::<Vec<_>>(),
            ["a", "a.b", "a.b[3]", "a.b[3].c"]
        );
        assert_eq!(prefixes("a").collect::<Vec<_>>(), ["a"]);
    }
}
