//! The `tls` section of an `egress-connect` listener and of a route's `egress`: the server
//! certificate chain, its private key and the CA bundle client certificates must chain to,
//! as three PEM files. A listener's is decoded straight into [`TlsFiles`]; a route's, in the
//! routing table's schema, is [`RawTls`] and validated with the route. Relative paths are
//! resolved against the directory of the file that names them. The files themselves are
//! read by [`crate::net::tls`] (and by `trellis check` through it), never here.

use std::path::{Path, PathBuf};

pub use crate::route::TlsFiles;

use serde::{Deserialize, Serialize};

use super::decode::{Derived, MappingOnly};
use super::error::Errors;
use super::value::{FilePath, plain};

mapping_only!(RawTls);
serialize_derived!(RawTls);

/// A `tls` section decoded into the files it names.
#[derive(Deserialize)]
#[serde(remote = "TlsFiles", rename_all = "camelCase")]
struct TlsFilesDef {
    /// PEM file with the server certificate first, then its intermediates.
    #[serde(deserialize_with = "plain::<FilePath, _>")]
    certificate_file: PathBuf,
    /// PEM file with the certificate's private key (PKCS#8, PKCS#1 or SEC1).
    #[serde(deserialize_with = "plain::<FilePath, _>")]
    key_file: PathBuf,
    /// PEM file with the CA certificates a client certificate must chain to.
    #[serde(rename = "clientCAFile", deserialize_with = "plain::<FilePath, _>")]
    client_ca_file: PathBuf,
}

impl<'de> Deserialize<'de> for TlsFiles {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(MappingOnly::<TlsFiles>::new())
    }
}

impl<'de> Derived<'de> for TlsFiles {
    fn derived<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        TlsFilesDef::deserialize(d)
    }
}

/// A `tls` section as a routing table has it.
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

/// Validates `raw` at `path` (e.g. `routes[1].egress.tls`); relative paths are taken
/// relative to `dir`. Every problem is recorded in `errors`.
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
