//! The extension's heartbeat: the Lease `gardener-extension-heartbeat` in its own namespace,
//! created if missing and renewed every interval (`spec.renewTime`, `holderIdentity`,
//! `leaseDurationSeconds` = the interval), as gardener/gardener v1.149.3
//! `extensions/pkg/controller/heartbeat/reconciler.go` does (get, create if absent, else merge
//! patch). gardenlet reads it to tell a running extension from a stuck one. It writes
//! nothing else.

use std::future::Future;
use std::time::Duration;

use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

use super::reconcile::resource;

/// The Lease's name.
pub const LEASE: &str = "gardener-extension-heartbeat";

/// The Lease's spec at `now`.
fn spec(holder: &str, interval: Duration, now: Timestamp) -> Value {
    let seconds = interval.as_secs().max(1);
    json!({
        "holderIdentity": holder,
        "leaseDurationSeconds": seconds,
        "renewTime": format!("{now:.6}"),
    })
}

/// Renews the Lease once (creates it when missing).
pub async fn renew(
    client: &kube::Client,
    namespace: &str,
    holder: &str,
    interval: Duration,
) -> Result<(), kube::Error> {
    let ar = resource("coordination.k8s.io", "v1", "Lease", "leases");
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), namespace, &ar);
    let spec = spec(holder, interval, Timestamp::now());
    if api.get_opt(LEASE).await?.is_none() {
        let lease = json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": { "name": LEASE, "namespace": namespace },
            "spec": spec,
        });
        let lease: DynamicObject =
            serde_json::from_value(lease).map_err(kube::Error::SerdeError)?;
        match api.create(&PostParams::default(), &lease).await {
            Ok(_) => return Ok(()),
            // Created meanwhile (another replica): patched below.
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(e),
        }
    }
    let patch = json!({ "spec": spec });
    api.patch(LEASE, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// Renews the Lease every `interval` until `stop` completes; a failed renewal is logged and
/// tried again at the next tick.
pub async fn run(
    client: kube::Client,
    namespace: String,
    holder: String,
    interval: Duration,
    stop: impl Future<Output = ()>,
) {
    let mut stop = std::pin::pin!(stop);
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if let Err(e) = renew(&client, &namespace, &holder, interval).await {
                    tracing::warn!(namespace, lease = LEASE, error = %e, "renewing the heartbeat Lease");
                }
            }
            () = &mut stop => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_has_microseconds_and_whole_seconds() {
        let now: Timestamp = "2025-03-01T10:00:00.123456789Z"
            .parse()
            .unwrap_or(Timestamp::UNIX_EPOCH);
        let s = spec("trellis", Duration::from_millis(300), now);
        assert_eq!(s["renewTime"], "2025-03-01T10:00:00.123456Z");
        assert_eq!(s["leaseDurationSeconds"], 1);
        assert_eq!(s["holderIdentity"], "trellis");
    }
}
