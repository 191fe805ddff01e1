//! The `tls` section of an `egress-connect` listener and of a route's `egress`: the server
//! certificate chain, its private key and the CA bundle client certificates must chain to,
//! as three PEM files. Validation resolves relative paths (against the directory of the file
//! that names them) and, where asked, reads and checks the files themselves (see
//! [`crate::net::tls`]); it never keeps their contents.

use std::path::{Path, PathBuf};

pub use crate::route::TlsFiles;

use serde::{Deserialize, Serialize};

use super::Errors;

mapping_only!(RawTls);
serialize_derived!(RawTls);

/// A `tls` section as written.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
#[serde(remote = "Self", rename_all = "camelCase")]
pub struct RawTls {
    /// PEM file with the server certificate first, then its intermediates.
    pub certificate_file: String,
    /// PEM file with the certificate's private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: String,
    /// PEM file with the CA certificates a client certificate must chain to.
    #[serde(rename = "clientCAFile")]
    pub client_ca_file: String,
}

/// Validates `raw` at `path` (e.g. `listeners[1].tls`); relative paths are taken relative to
/// `dir`. Every problem is recorded in `errors`.
pub(crate) fn files(errors: &mut Errors, path: &str, dir: &Path, raw: &RawTls) -> Option<TlsFiles> {
    let mut ok = true;
    let mut one = |field: &str, value: &str| {
        if value.is_empty() {
            errors.push(format!("{path}.{field}"), "must not be empty");
            ok = false;
        }
        let p = PathBuf::from(value);
        if p.is_relative() { dir.join(p) } else { p }
    };
    let certificate = one("certificateFile", &raw.certificate_file);
    let key = one("keyFile", &raw.key_file);
    let client_ca = one("clientCAFile", &raw.client_ca_file);
    ok.then_some(TlsFiles {
        certificate_file: certificate,
        key_file: key,
        client_ca_file: client_ca,
    })
}

/// For `trellis check`: loads the material `raw` names (relative to `dir`) and records, at
/// `path`, why it cannot serve (unreadable, not PEM, the key not the certificate's, no CA).
/// Problems with the section itself are left to validation, which reports them.
pub(crate) fn check_material(errors: &mut Errors, path: &str, dir: &Path, raw: &RawTls) {
    let mut ignored = Errors::default();
    if let Some(files) = files(&mut ignored, path, dir, raw)
        && let Err(e) = crate::net::tls::load(&files)
    {
        errors.push(path, e);
    }
}
