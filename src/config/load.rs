//! The one loader: a [`ConfigKind`] names its `kind`, what its file decodes into and the
//! rules across its fields; [`load`] reads any kind the same way (size cap, one decode that
//! goes past type errors, validation, every problem located in the text). A process reads
//! its own kind through it; `trellis check` reads any kind through the same steps.

use std::path::Path;

use serde::Deserializer;

use super::decode::{self, Kinds, MAX_FILE_BYTES, Recovery};
use super::error::{ConfigError, Errors, invalid};

/// One kind of file: `kind: GatewayConfiguration` and the type it becomes.
pub trait ConfigKind: Sized {
    /// The `kind` as written in files.
    const KIND: &'static str;
    /// What reads files of this kind, for the error about a file of another kind
    /// (`'trellis gateway'`).
    const READ_BY: &'static str;
    /// What the file decodes into: the kind itself, or the schema it is built from where
    /// validation builds something new (a routing table's indexes).
    type File: for<'de> serde::Deserialize<'de>;
    /// What validation needs besides the file (nothing, for most kinds).
    type Context<'a>;
    /// The rules across fields (each field's own were kept by decoding it): every problem
    /// recorded in `errors`; relative file names made relative to the file's directory.
    fn validate(
        file: Self::File,
        source: &Source<'_>,
        cx: Self::Context<'_>,
        errors: &mut Errors,
    ) -> Self;
}

/// The file being validated.
#[derive(Debug, Clone, Copy)]
pub struct Source<'a> {
    /// Its name.
    pub path: &'a Path,
    /// Its bytes.
    pub bytes: &'a [u8],
}

impl Source<'_> {
    /// The directory relative file names in it are relative to.
    pub fn dir(&self) -> &Path {
        self.path.parent().unwrap_or(Path::new("."))
    }
}

/// Reads and validates a file of kind `K`.
pub fn load<K>(file: &Path) -> Result<K, ConfigError>
where
    K: for<'a> ConfigKind<Context<'a> = ()>,
{
    parse(file, &read_file(file)?)
}

/// Validates the bytes of a file of kind `K` read from `file`.
pub fn parse<K>(file: &Path, bytes: &[u8]) -> Result<K, ConfigError>
where
    K: for<'a> ConfigKind<Context<'a> = ()>,
{
    parse_with(file, bytes, (), Recovery::All)
}

/// [`parse`] with the kind's context, going past type errors as far as `recovery` says.
pub fn parse_with<K: ConfigKind>(
    file: &Path,
    bytes: &[u8],
    cx: K::Context<'_>,
    recovery: Recovery,
) -> Result<K, ConfigError> {
    let result = decode::decode::<One<K>>(file, bytes, recovery).and_then(|(one, mut errors)| {
        let source = Source { path: file, bytes };
        let value = K::validate(one.0, &source, cx, &mut errors);
        errors.finish(file, value)
    });
    decode::located(file, bytes, result)
}

/// The decode of one kind.
pub(crate) struct One<K: ConfigKind>(pub(crate) K::File);

impl<K: ConfigKind> Kinds for One<K> {
    fn names() -> Vec<&'static str> {
        vec![K::KIND]
    }

    fn decode<'de, D: Deserializer<'de>>(_kind: &str, d: D) -> Result<Self, D::Error> {
        serde::Deserialize::deserialize(d).map(One)
    }

    /// `kind RoutingTable, but 'trellis gateway' needs a GatewayConfiguration`.
    fn other(file: &Path, kind: &str) -> Option<ConfigError> {
        let article = if K::KIND.starts_with(['A', 'E', 'I', 'O', 'U']) {
            "an"
        } else {
            "a"
        };
        let message = format!(
            "kind {kind}, but {} needs {article} {}",
            K::READ_BY,
            K::KIND
        );
        Some(invalid(file, "", message))
    }
}

/// Reads a file with a size cap.
pub fn read_file(file: &Path) -> Result<Vec<u8>, ConfigError> {
    use std::io::Read;
    let read_err = |source| ConfigError::Read {
        file: file.to_owned(),
        source,
    };
    let f = std::fs::File::open(file).map_err(read_err)?;
    // Sized up front (the file may still change between stat and read; read_to_end grows
    // the buffer then): a buffer grown by doubling is reallocated inside the heap, and a
    // routing table's megabytes stay resident after it is freed; one allocation this large
    // gets its own mapping and is returned on free.
    let hint = f.metadata().map_or(0, |m| m.len());
    if hint > MAX_FILE_BYTES {
        // Rejected before reading: a watch event must not read 64 MiB each time.
        return Err(too_large(file));
    }
    let mut bytes = Vec::with_capacity(hint as usize + 1);
    f.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(read_err)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(too_large(file));
    }
    Ok(bytes)
}

fn too_large(file: &Path) -> ConfigError {
    invalid(file, "", format!("file larger than {MAX_FILE_BYTES} bytes"))
}
