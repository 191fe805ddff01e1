//! Link and address management over rtnetlink (replaces Gardener's netlink sidecar).
//!
//! Keeps one address on one link: creates the link as a dummy device when it is missing
//! (falling back to `lo`, with a warning, when the kernel has no dummy driver), brings it up,
//! adds the address as /32 or /128 with global scope, and removes the same address from every
//! other link. [`LinkManager::reconcile`] is idempotent; the node runs it at start, after
//! netlink address/link events, and on a timer. Never shells out to `ip`.

use std::net::IpAddr;

use futures_util::TryStreamExt;
use netlink_packet_route::address::{AddressAttribute, AddressMessage, AddressScope};
use rtnetlink::{Handle, LinkDummy, LinkUnspec};
use thiserror::Error;

/// Link used when the kernel cannot create dummy links.
pub(crate) const FALLBACK_LINK: &str = "lo";

/// A failed netlink operation.
#[derive(Debug, Error)]
#[error("{op}: {source}")]
pub(crate) struct LinkError {
    /// What was being done.
    pub op: String,
    /// The netlink error.
    #[source]
    pub source: rtnetlink::Error,
}

impl LinkError {
    /// Whether the kernel refused for lack of privilege (`EPERM`, `EACCES`): changing links
    /// and addresses needs `CAP_NET_ADMIN`.
    pub(crate) fn is_permission_denied(&self) -> bool {
        match &self.source {
            rtnetlink::Error::NetlinkError(e) => [
                rustix::io::Errno::PERM.raw_os_error(),
                rustix::io::Errno::ACCESS.raw_os_error(),
            ]
            .iter()
            .any(|&code| e.raw_code() == -code),
            _ => false,
        }
    }
}

fn err(op: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> LinkError {
    let op = op.into();
    move |source| LinkError { op, source }
}

/// What a reconcile changed, for logs.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Changes {
    /// The link was created.
    pub created_link: bool,
    /// The address was added.
    pub added: bool,
    /// Links the address was removed from.
    pub removed_from: Vec<u32>,
}

impl std::fmt::Display for Changes {
    /// `created link, added address, removed from links 3 7` (only what happened).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if self.created_link {
            parts.push("created link".to_string());
        }
        if self.added {
            parts.push("added address".to_string());
        }
        if !self.removed_from.is_empty() {
            let links: Vec<String> = self.removed_from.iter().map(u32::to_string).collect();
            parts.push(format!("removed from links {}", links.join(" ")));
        }
        if parts.is_empty() {
            parts.push("nothing".into());
        }
        f.write_str(&parts.join(", "))
    }
}

/// Keeps `address` on link `name`.
pub(crate) struct LinkManager {
    handle: Handle,
    name: String,
    address: IpAddr,
    /// The link actually used (the configured one, or the fallback).
    effective: String,
}

impl LinkManager {
    /// A manager using `handle` (an rtnetlink connection whose task is already running).
    pub(crate) fn new(handle: Handle, name: &str, address: IpAddr) -> Self {
        LinkManager {
            handle,
            name: name.to_owned(),
            address,
            effective: name.to_owned(),
        }
    }

    /// The link the address lives on.
    pub(crate) fn link(&self) -> &str {
        &self.effective
    }

    async fn link_index(&self, name: &str) -> Result<Option<u32>, LinkError> {
        let mut links = self
            .handle
            .link()
            .get()
            .match_name(name.to_owned())
            .execute();
        match links.try_next().await {
            Ok(Some(link)) => Ok(Some(link.header.index)),
            Ok(None) => Ok(None),
            // ENODEV: no such link.
            Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc_enodev() => Ok(None),
            Err(e) => Err(err(format!("looking up link {name}"))(e)),
        }
    }

    /// Finds or creates the link; falls back to `lo` only when the kernel cannot create
    /// dummy links. The configured link is looked up first on every reconcile, so once it
    /// appears (created by someone else, or after a race) the address moves to it.
    async fn ensure_link(&mut self, changes: &mut Changes) -> Result<u32, LinkError> {
        if let Some(index) = self.link_index(&self.name).await? {
            self.effective = self.name.clone();
            return Ok(index);
        }
        match self
            .handle
            .link()
            .add(LinkDummy::new(&self.name).build())
            .execute()
            .await
        {
            Ok(()) => {
                changes.created_link = true;
                tracing::info!(link = %self.name, "created dummy link");
                self.effective = self.name.clone();
            }
            // Created concurrently by someone else: use it.
            Err(rtnetlink::Error::NetlinkError(e))
                if e.raw_code() == -rustix::io::Errno::EXIST.raw_os_error() =>
            {
                self.effective = self.name.clone();
            }
            // The kernel has no dummy driver: EOPNOTSUPP ("Unknown device type").
            Err(rtnetlink::Error::NetlinkError(e))
                if e.raw_code() == -rustix::io::Errno::OPNOTSUPP.raw_os_error() =>
            {
                if self.effective != FALLBACK_LINK {
                    tracing::warn!(
                        link = %self.name,
                        fallback = FALLBACK_LINK,
                        "cannot create a dummy link: this kernel has no dummy driver; using the fallback link instead"
                    );
                }
                self.effective = FALLBACK_LINK.to_owned();
            }
            Err(e) => return Err(err(format!("creating dummy link {}", self.name))(e)),
        }
        self.link_index(&self.effective)
            .await?
            .ok_or_else(|| LinkError {
                op: format!("link {} missing after creation", self.effective),
                source: rtnetlink::Error::RequestFailed,
            })
    }

    /// Every address entry equal to ours, on any link.
    async fn our_addresses(&self) -> Result<Vec<AddressMessage>, LinkError> {
        let all: Vec<AddressMessage> = self
            .handle
            .address()
            .get()
            .execute()
            .try_collect()
            .await
            .map_err(err("listing addresses"))?;
        Ok(all
            .into_iter()
            .filter(|m| {
                m.attributes.iter().any(|a| matches!(a, AddressAttribute::Local(ip) | AddressAttribute::Address(ip) if *ip == self.address))
            })
            .collect())
    }

    fn max_prefix(&self) -> u8 {
        if self.address.is_ipv4() { 32 } else { 128 }
    }

    /// Makes the state right; returns what changed.
    pub(crate) async fn reconcile(&mut self) -> Result<Changes, LinkError> {
        let mut changes = Changes::default();
        let index = self.ensure_link(&mut changes).await?;
        self.handle
            .link()
            .set(LinkUnspec::new_with_index(index).up().build())
            .execute()
            .await
            .map_err(err(format!("setting link {} up", self.effective)))?;
        let mut present = false;
        for msg in self.our_addresses().await? {
            if self.is_wanted(&msg, index) {
                present = true;
                continue;
            }
            let from = self.delete(msg).await?;
            tracing::info!(address = %self.address, link_index = from, "removed the address from another link");
            changes.removed_from.push(from);
        }
        if !present {
            let mut req = self
                .handle
                .address()
                .add(index, self.address, self.max_prefix());
            req.message_mut().header.scope = AddressScope::Universe;
            req.execute().await.map_err(err(format!(
                "adding {} to {}",
                self.address, self.effective
            )))?;
            tracing::info!(address = %self.address, link = %self.effective, "address added");
            changes.added = true;
        }
        Ok(changes)
    }

    /// Whether the address is on the link now, as wanted.
    pub(crate) async fn is_in_place(&self) -> Result<bool, LinkError> {
        let Some(index) = self.link_index(&self.effective).await? else {
            return Ok(false);
        };
        Ok(self
            .our_addresses()
            .await?
            .iter()
            .any(|m| self.is_wanted(m, index)))
    }

    /// Whether `msg` is our address as wanted: on link `index`, host prefix, global scope.
    fn is_wanted(&self, msg: &AddressMessage, index: u32) -> bool {
        msg.header.index == index
            && msg.header.prefix_len == self.max_prefix()
            && msg.header.scope == AddressScope::Universe
    }

    /// Deletes one address entry; returns the index of the link it was on.
    async fn delete(&self, msg: AddressMessage) -> Result<u32, LinkError> {
        let from = msg.header.index;
        self.handle
            .address()
            .del(msg)
            .execute()
            .await
            .map_err(err(format!("removing {} from link {from}", self.address)))?;
        Ok(from)
    }

    /// Removes the address from every link that has it (`--cleanup`).
    pub(crate) async fn remove(&self) -> Result<usize, LinkError> {
        let mut n = 0;
        for msg in self.our_addresses().await? {
            self.delete(msg).await?;
            n += 1;
        }
        Ok(n)
    }
}

fn libc_enodev() -> i32 {
    rustix::io::Errno::NODEV.raw_os_error()
}

/// Opens an rtnetlink connection for requests.
pub(crate) fn connect() -> std::io::Result<Handle> {
    let (conn, handle, _) = rtnetlink::new_connection()?;
    tokio::spawn(conn);
    Ok(handle)
}

/// Opens a netlink socket subscribed to link and address changes; every message on the
/// returned channel means "something changed, reconcile".
pub(crate) fn subscribe() -> std::io::Result<tokio::sync::mpsc::Receiver<()>> {
    use futures_util::StreamExt;
    use netlink_sys::{AsyncSocket, SocketAddr};
    use rtnetlink::constants::{RTMGRP_IPV4_IFADDR, RTMGRP_IPV6_IFADDR, RTMGRP_LINK};
    let (mut conn, _, mut messages) = rtnetlink::new_connection()?;
    conn.socket_mut().socket_mut().bind(&SocketAddr::new(
        0,
        RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR,
    ))?;
    tokio::spawn(conn);
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        while messages.next().await.is_some() {
            // A full channel already holds a pending reconcile.
            let _ = tx.try_send(());
        }
    });
    Ok(rx)
}
