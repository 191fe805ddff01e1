//! What is wrong with a file: every problem with its field path and, once located, its line
//! and column. This module reads no files and knows no kind.

use std::fmt;
use std::path::{Path, PathBuf};

use thiserror::Error;

use super::recover;

/// One problem in a file, at a field path such as `listeners[2].address`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    /// Field path; empty for the document itself.
    pub path: String,
    /// What is wrong.
    pub message: String,
    /// Line and column (from 1); `None` until the problem is located in the text.
    pub position: Option<(u64, u64)>,
}

impl fmt::Display for FieldError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            f.write_str(&self.message)
        } else {
            write!(f, "{}: {}", self.path, self.message)
        }
    }
}

/// Why a file could not be used.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("{}: {source}", file.display())]
    Read {
        /// The file.
        file: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The file was read but is not valid; every problem found is listed.
    #[error("{}", Invalid(file, errors))]
    Invalid {
        /// The file.
        file: PathBuf,
        /// Every problem, each with its field path.
        errors: Vec<FieldError>,
    },
}

struct Invalid<'a>(&'a Path, &'a [FieldError]);

impl fmt::Display for Invalid<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.1.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{}", self.0.display())?;
            if let Some((line, column)) = e.position {
                write!(f, ":{line}:{column}")?;
            }
            write!(f, ": {e}")?;
        }
        Ok(())
    }
}

impl ConfigError {
    /// Stable short name for metric labels.
    pub fn kind(&self) -> &'static str {
        match self {
            ConfigError::Read { .. } => "read",
            ConfigError::Invalid { .. } => "invalid",
        }
    }
}

/// Collects problems with their paths.
#[derive(Debug, Default)]
pub struct Errors {
    /// The problems, in the order found.
    pub(super) found: Vec<FieldError>,
    /// Paths whose value was refused when the file was decoded and was decoded as a
    /// stand-in: what a cross-field rule finds there is not another problem.
    shadowed: Vec<String>,
}

impl Errors {
    /// What decoding found: values refused (decoded as stand-ins at the `shadowed` paths)
    /// and unknown fields.
    pub(super) fn found(
        wrong: Vec<FieldError>,
        unknown: Vec<FieldError>,
        shadowed: Vec<String>,
    ) -> Self {
        let mut found = wrong;
        found.extend(unknown);
        Errors { found, shadowed }
    }

    /// How many problems are recorded.
    pub fn len(&self) -> usize {
        self.found.len()
    }

    /// Whether no problem is recorded.
    pub fn is_empty(&self) -> bool {
        self.found.is_empty()
    }

    /// Whether the value at `path`, or one inside it, was refused when the file was decoded
    /// (or `path` is inside one): a rule across fields that reads it reads a stand-in, and
    /// would report a problem the file does not have.
    pub(crate) fn refused(&self, path: &str) -> bool {
        self.shadowed
            .iter()
            .any(|s| recover::within(path, s) || recover::within(s, path))
    }

    /// Whether a problem is recorded at `path` or inside it, or its value was refused: what
    /// the field holds is not what a rule (or a file read) should go on with.
    pub(crate) fn at_or_in(&self, path: &str) -> bool {
        self.refused(path) || self.found.iter().any(|e| recover::within(&e.path, path))
    }

    /// Records a problem at `path`, unless the value there (or around it) was refused when
    /// the file was decoded: that was reported then.
    pub fn push(&mut self, path: impl fmt::Display, message: impl fmt::Display) {
        let path = path.to_string();
        if self.shadowed.iter().any(|s| recover::within(&path, s)) {
            return;
        }
        self.found.push(FieldError {
            path,
            message: message.to_string(),
            position: None,
        });
    }

    /// Turns the collected errors into a result for `file`.
    pub fn finish<T>(self, file: &Path, value: T) -> Result<T, ConfigError> {
        if self.found.is_empty() {
            Ok(value)
        } else {
            Err(ConfigError::Invalid {
                file: file.to_owned(),
                errors: self.found,
            })
        }
    }
}

/// The error of `file` with one problem at `path`.
pub(super) fn invalid(file: &Path, path: &str, message: impl fmt::Display) -> ConfigError {
    ConfigError::Invalid {
        file: file.to_owned(),
        errors: vec![FieldError {
            path: path.into(),
            message: message.to_string(),
            position: None,
        }],
    }
}

/// Joins `name[index]` or `name.field` paths.
pub(crate) fn at(base: impl fmt::Display, field: impl fmt::Display) -> String {
    format!("{base}.{field}")
}
