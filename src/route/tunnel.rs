//! A route's WireGuard tunnel as the routing table describes it: the shoot-side peers (their
//! public keys and the networks each may send from) and the gateway's own addresses inside
//! the shoot. Plain values: the tunnel driver reconciles its peers and stacks against them on
//! every applied table. No I/O besides [`read_key_file`].

use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use thiserror::Error;

use super::Net;

/// A WireGuard key (Curve25519, 32 bytes), written as standard base64 the way `wg genkey` and
/// `wg pubkey` print it. [`fmt::Debug`] prints the base64, so hold private keys elsewhere
/// (the tunnel's device keeps its own secret type).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct WgKey(pub [u8; 32]);

/// Why a key string is not a WireGuard key.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum KeyError {
    /// Not standard base64.
    #[error("not base64 (a WireGuard key is 44 characters as `wg genkey` writes it)")]
    NotBase64,
    /// Base64 of the wrong number of bytes.
    #[error("a WireGuard key is 32 bytes, this is {0}")]
    Length(usize),
}

impl WgKey {
    /// Parses standard base64 of exactly 32 bytes (surrounding whitespace ignored).
    pub fn from_base64(s: &str) -> Result<WgKey, KeyError> {
        let bytes = STANDARD.decode(s.trim()).map_err(|_| KeyError::NotBase64)?;
        let key: [u8; 32] = bytes
            .as_slice()
            .try_into()
            .map_err(|_| KeyError::Length(bytes.len()))?;
        Ok(WgKey(key))
    }

    /// The key as standard base64.
    pub fn to_base64(&self) -> String {
        STANDARD.encode(self.0)
    }
}

impl fmt::Debug for WgKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_base64())
    }
}

/// Why a key file could not be used.
#[derive(Debug, Error)]
pub enum KeyFileError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The read error.
        source: std::io::Error,
    },
    /// The file holds no valid key.
    #[error("{path}: {source}")]
    Key {
        /// The file.
        path: PathBuf,
        /// What is wrong with its content.
        source: KeyError,
    },
}

/// Reads a key file as `wg genkey` writes it (base64 and a newline).
pub fn read_key_file(path: &Path) -> Result<WgKey, KeyFileError> {
    let text = std::fs::read_to_string(path).map_err(|source| KeyFileError::Read {
        path: path.to_owned(),
        source,
    })?;
    WgKey::from_base64(&text).map_err(|source| KeyFileError::Key {
        path: path.to_owned(),
        source,
    })
}

/// A route's WireGuard tunnel (`tunnel.wireguard`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tunnel {
    /// The shoot-side peers (e.g. two agent replicas); each public key appears once per table.
    pub peers: Box<[TunnelPeer]>,
    /// The gateway's addresses inside the shoot, at most one per family; outside every peer's
    /// `allowedIPs`.
    pub local_addresses: Box<[IpAddr]>,
}

/// One shoot-side peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TunnelPeer {
    /// Its public key.
    pub public_key: WgKey,
    /// The inner source addresses it may send from, and the targets it is chosen for.
    pub allowed_ips: Box<[Net]>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_32_bytes_of_base64() {
        let k = WgKey([7; 32]);
        assert_eq!(WgKey::from_base64(&k.to_base64()), Ok(k));
        assert_eq!(WgKey::from_base64(&format!("{}\n", k.to_base64())), Ok(k));
        assert_eq!(
            WgKey::from_base64(&STANDARD.encode([1u8; 31])),
            Err(KeyError::Length(31))
        );
        assert_eq!(WgKey::from_base64("not a key!"), Err(KeyError::NotBase64));
    }
}
