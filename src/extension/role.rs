//! The Extension types trellis serves and the webhook targets of each: generic over the role,
//! so that a later type (`trellis-vpn`) is one more variant with its own targets, through the
//! same controller, webhook paths and server.

use std::fmt;

/// An Extension type (`spec.type` of `extensions.gardener.cloud/v1alpha1 Extension`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ExtensionType {
    /// `trellis-node`: the shoot's `apiserver-proxy` DaemonSet runs `trellis node`.
    Node,
}

impl ExtensionType {
    /// Every type, in order.
    pub const ALL: [ExtensionType; 1] = [ExtensionType::Node];

    /// The type's name, as in `spec.extensions[].type` of a Shoot.
    pub fn name(self) -> &'static str {
        match self {
            ExtensionType::Node => "trellis-node",
        }
    }

    /// The type named `name`.
    pub fn from_name(name: &str) -> Option<ExtensionType> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }

    /// The label gardenlet puts on a shoot namespace whose shoot has this extension
    /// (`extensions.gardener.cloud/trellis-node`, value `true`).
    pub fn namespace_label(self) -> String {
        format!("extensions.gardener.cloud/{}", self.name())
    }

    /// The name of the ManagedResource the controller writes per shoot for this type
    /// (`extension-trellis-node`).
    pub fn managed_resource(self) -> String {
        format!("extension-{}", self.name())
    }

    /// The webhook targets of this type.
    pub fn targets(self) -> &'static [Target] {
        match self {
            ExtensionType::Node => &[Target::ApiserverProxy],
        }
    }
}

impl fmt::Display for ExtensionType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What a webhook path mutates: the last segment of `/shoot/<shoot-namespace>/<target>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Target {
    /// The shoot's `kube-system/apiserver-proxy` DaemonSet (called by the shoot's API server).
    ApiserverProxy,
}

/// What the API server does when a webhook cannot be reached or fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailurePolicy {
    /// Admit the object unchanged.
    Ignore,
    /// Refuse the write.
    Fail,
}

impl FailurePolicy {
    /// As written in a webhook configuration.
    pub fn name(self) -> &'static str {
        match self {
            FailurePolicy::Ignore => "Ignore",
            FailurePolicy::Fail => "Fail",
        }
    }
}

impl Target {
    /// Every target.
    pub const ALL: [Target; 1] = [Target::ApiserverProxy];

    /// The path segment and the `target` label of `trellis_extension_admissions_total`.
    pub fn name(self) -> &'static str {
        match self {
            Target::ApiserverProxy => "apiserver-proxy",
        }
    }

    /// The target named `name` (a path's last segment).
    pub fn from_name(name: &str) -> Option<Target> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }

    /// The type whose target this is.
    pub fn extension_type(self) -> ExtensionType {
        match self {
            Target::ApiserverProxy => ExtensionType::Node,
        }
    }

    /// Its failure policy: what the API server does when the webhook fails, and what a
    /// handler failure answers (`Fail`: `allowed: false` with the reason; `Ignore`: allowed,
    /// no patch).
    pub fn failure_policy(self) -> FailurePolicy {
        match self {
            Target::ApiserverProxy => FailurePolicy::Ignore,
        }
    }

    /// The webhook's path for the shoot in `shoot_namespace`.
    pub fn path(self, shoot_namespace: &str) -> String {
        format!("/shoot/{shoot_namespace}/{}", self.name())
    }
}

/// A webhook path, `/shoot/<shoot-namespace>/<target>`, split (`None`: any other path).
pub fn parse_path(path: &str) -> Option<(&str, Target)> {
    let rest = path.strip_prefix("/shoot/")?;
    let (namespace, target) = rest.split_once('/')?;
    if namespace.is_empty() || !crate::config::extension::dns_label(namespace) {
        return None;
    }
    Some((namespace, Target::from_name(target)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_round_trip_and_others_are_refused() {
        let p = Target::ApiserverProxy.path("shoot--dev--alpha");
        assert_eq!(p, "/shoot/shoot--dev--alpha/apiserver-proxy");
        assert_eq!(
            parse_path(&p),
            Some(("shoot--dev--alpha", Target::ApiserverProxy))
        );
        for bad in [
            "/shoot//apiserver-proxy",
            "/shoot/a/b/apiserver-proxy",
            "/shoot/a/unknown",
            "/seed/a/apiserver-proxy",
            "/shoot/A_B/apiserver-proxy",
            "/shoot/a/apiserver-proxy/",
        ] {
            assert_eq!(parse_path(bad), None, "{bad}");
        }
        assert_eq!(
            ExtensionType::from_name("trellis-node"),
            Some(ExtensionType::Node)
        );
        assert_eq!(ExtensionType::from_name("trellis-vpn"), None);
    }
}
