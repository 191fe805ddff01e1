//! A route's WireGuard tunnel as the routing table describes it: the shoot-side peers (their
//! public keys and the networks each may send from) and the gateway's own addresses inside
//! the shoot. Plain values: the tunnel driver reconciles its peers and stacks against them on
//! every applied table. [`Tunnel::view`] renders one for `/routes` in the table file's shape,
//! with room for the driver's live state of each peer. No I/O besides [`read_key_file`].

use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use serde::Serialize;
use serde::ser::{SerializeMap, Serializer};
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

impl Tunnel {
    /// The tunnel as `/routes` shows it: the table file's shape
    /// (`{"wireguard": {"peers": [{"publicKey", "allowedIPs"}], "localAddresses"}}`), each
    /// peer with a `state` entry where `live` has one for the peer's index in the route.
    pub fn view<'a>(&'a self, live: Option<PeerState<'a>>) -> TunnelView<'a> {
        TunnelView { tunnel: self, live }
    }
}

/// The live state of a route's peer for `/routes`, by the peer's index in the route (the
/// tunnel driver knows it: endpoint, last handshake, streams); `None` adds nothing.
pub type PeerState<'a> = &'a dyn Fn(usize) -> Option<serde_json::Value>;

/// A [`Tunnel`] rendered for `/routes` ([`Tunnel::view`]).
#[derive(Clone, Copy)]
pub struct TunnelView<'a> {
    tunnel: &'a Tunnel,
    live: Option<PeerState<'a>>,
}

impl Serialize for TunnelView<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        /// `tunnel.wireguard`.
        struct WireGuard<'a>(TunnelView<'a>);
        /// One peer, with its index for the live state.
        struct Peer<'a>(&'a TunnelPeer, Option<serde_json::Value>);
        impl Serialize for WireGuard<'_> {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let TunnelView { tunnel, live } = self.0;
                let peers: Vec<Peer<'_>> = tunnel
                    .peers
                    .iter()
                    .enumerate()
                    .map(|(i, p)| Peer(p, live.and_then(|f| f(i))))
                    .collect();
                let mut m = s.serialize_map(Some(2))?;
                m.serialize_entry("peers", &peers)?;
                m.serialize_entry("localAddresses", &tunnel.local_addresses)?;
                m.end()
            }
        }
        impl Serialize for Peer<'_> {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                let allowed: Vec<String> = self.0.allowed_ips.iter().map(Net::to_string).collect();
                let mut m = s.serialize_map(None)?;
                m.serialize_entry("publicKey", &self.0.public_key.to_base64())?;
                m.serialize_entry("allowedIPs", &allowed)?;
                if let Some(state) = &self.1 {
                    m.serialize_entry("state", state)?;
                }
                m.end()
            }
        }
        let mut m = s.serialize_map(Some(1))?;
        m.serialize_entry("wireguard", &WireGuard(*self))?;
        m.end()
    }
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

    #[test]
    fn the_view_has_the_table_shape_and_the_live_state() {
        let t = Tunnel {
            peers: vec![
                TunnelPeer {
                    public_key: WgKey([1; 32]),
                    allowed_ips: vec![Net::parse("10.250.0.0/16").unwrap()].into(),
                },
                TunnelPeer {
                    public_key: WgKey([2; 32]),
                    allowed_ips: vec![Net::parse("192.168.128.6").unwrap()].into(),
                },
            ]
            .into(),
            local_addresses: vec!["192.168.128.1".parse().unwrap()].into(),
        };
        let k = |b: u8| WgKey([b; 32]).to_base64();
        let plain = serde_json::to_value(t.view(None)).unwrap();
        assert_eq!(
            plain,
            serde_json::json!({"wireguard": {
                "peers": [
                    {"publicKey": k(1), "allowedIPs": ["10.250.0.0/16"]},
                    {"publicKey": k(2), "allowedIPs": ["192.168.128.6/32"]},
                ],
                "localAddresses": ["192.168.128.1"],
            }})
        );
        // The hook is asked per peer index; a peer it knows nothing about gets no state.
        let live = |i: usize| (i == 1).then(|| serde_json::json!({"endpoint": "203.0.113.9:1"}));
        let with = serde_json::to_value(t.view(Some(&live))).unwrap();
        let peers = &with["wireguard"]["peers"];
        assert!(peers[0].get("state").is_none(), "{with}");
        assert_eq!(peers[1]["state"]["endpoint"], "203.0.113.9:1");
    }
}
