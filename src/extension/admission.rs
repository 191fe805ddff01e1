//! One webhook request in, its answer out: the path picks the shoot namespace and target,
//! the body must be an `admission.k8s.io/v1` AdmissionReview with a request, the caller must
//! be a kube-apiserver pod of that namespace (while none is known, the review is admitted
//! unchanged), and [`mutate::review`] decides; the answer is
//! counted (`trellis_extension_admissions_total{target,result}`). No I/O: the server hands
//! in the path, the peer's address and the body it read.
//!
//! The request is decoded into a small struct of its own rather than kube-core's
//! `AdmissionRequest<DynamicObject>`: the object is kept as raw JSON (unknown fields and all)
//! for the mutation, and the answer's `patch` is written base64-encoded, as the API server's
//! Go types (`[]byte`) encode it. Answers never carry the admitted object, nor anything of
//! a failure but a fixed reason.

use std::net::IpAddr;
use std::panic::AssertUnwindSafe;

use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::metrics::{ExtensionMetrics, Rejection};
use super::mutate::{self, Decision};
use super::role::{self, FailurePolicy, Target};
use super::state::{Caller, Shoot, State};

/// `result`: the namespace's kube-apiserver pods are known and the caller is none of them
/// (denied).
pub const DENIED_CALLER: &str = "denied_caller";
/// `result`: no kube-apiserver pod of the namespace is known yet, so the caller cannot be
/// verified: admitted unchanged, never patched, with a warning.
pub const CALLERS_UNKNOWN: &str = "callers_unknown";

/// The API version of the reviews answered.
pub const API_VERSION: &str = "admission.k8s.io/v1";

/// An HTTP answer: status, content type and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The HTTP status (200 for every review answered, allowed or not).
    pub status: u16,
    /// `application/json` for reviews, `text/plain` otherwise.
    pub content_type: &'static str,
    /// The body.
    pub body: Vec<u8>,
    /// What the server counts as refused (`None`: a review was answered).
    pub rejection: Option<Rejection>,
}

impl Answer {
    /// A plain-text refusal.
    pub fn refuse(why: Rejection, status: u16, text: &str) -> Answer {
        Answer {
            status,
            content_type: "text/plain; charset=utf-8",
            body: format!("{text}\n").into_bytes(),
            rejection: Some(why),
        }
    }
}

/// The parts of an AdmissionReview the webhooks read.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Review {
    api_version: String,
    kind: String,
    request: Option<Request>,
}

#[derive(Debug, Deserialize)]
struct Request {
    uid: String,
    #[serde(default)]
    object: Option<Value>,
}

/// The answer's review (`admission.k8s.io/v1`).
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct ReviewOut<'a> {
    api_version: &'static str,
    kind: &'static str,
    response: Response<'a>,
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Response<'a> {
    uid: &'a str,
    allowed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<Status>,
    #[serde(skip_serializing_if = "Option::is_none")]
    patch_type: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    patch: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    warnings: Vec<String>,
}

#[derive(Debug, Serialize)]
struct Status {
    code: u16,
    message: String,
}

/// Why a review could not be answered as decided.
#[derive(Debug, thiserror::Error)]
enum Failure {
    /// The mutation panicked.
    #[error("the mutation failed")]
    Panicked,
    /// The patch could not be encoded.
    #[error("the patch could not be encoded")]
    Patch,
}

/// Answers the request for `path` from `peer` with `body` (the server has checked the method
/// and the size).
pub fn answer(
    path: &str,
    peer: IpAddr,
    body: &[u8],
    state: &State,
    metrics: &ExtensionMetrics,
) -> Answer {
    answer_with(
        path,
        peer,
        body,
        state,
        metrics,
        &Target::failure_policy,
        &|t, s, o| Ok(mutate::review(t, s, o)),
    )
}

type Reviewer<'a> = &'a dyn Fn(Target, Option<&Shoot>, &Value) -> Result<Decision, ()>;

/// [`answer`] with the failure policy and the mutation given (tests reach the failure paths
/// through them).
fn answer_with(
    path: &str,
    peer: IpAddr,
    body: &[u8],
    state: &State,
    metrics: &ExtensionMetrics,
    policy: &dyn Fn(Target) -> FailurePolicy,
    review: Reviewer<'_>,
) -> Answer {
    let Some((namespace, target)) = role::parse_path(path) else {
        return Answer::refuse(Rejection::NotFound, 404, "no webhook at this path");
    };
    let request = match serde_json::from_slice::<Review>(body) {
        Ok(Review {
            api_version,
            kind,
            request: Some(request),
        }) if api_version == API_VERSION && kind == "AdmissionReview" => request,
        _ => {
            return Answer::refuse(
                Rejection::NotAReview,
                400,
                "expected an admission.k8s.io/v1 AdmissionReview with a request",
            );
        }
    };
    let uid = request.uid.as_str();
    let label = target.name();
    match state.caller(namespace, peer) {
        Caller::Allowed => {}
        Caller::Denied => {
            metrics.admission(label, DENIED_CALLER);
            return review_answer(Response {
                status: Some(Status {
                    code: 403,
                    message: format!(
                        "trellis: the caller is not a kube-apiserver of namespace {namespace}"
                    ),
                }),
                ..verdict(uid, false)
            });
        }
        // Before the Pod watch has listed, or before a new kube-apiserver pod's address has
        // arrived, a denial would refuse Gardener's own writes (a denial is no webhook
        // failure, so `failurePolicy: Ignore` would not apply): admit unchanged instead,
        // and never patch for a caller not verified.
        Caller::Unknown => {
            metrics.admission(label, CALLERS_UNKNOWN);
            tracing::warn!(
                target = label,
                namespace,
                %peer,
                "webhook caller not verified (no kube-apiserver pod of the namespace known yet): admitted unchanged"
            );
            return review_answer(Response {
                warnings: vec![format!(
                    "trellis {label}: no kube-apiserver of namespace {namespace} known yet: admitted unchanged"
                )],
                ..verdict(uid, true)
            });
        }
    }
    let Some(object) = request.object.as_ref() else {
        metrics.admission(label, "no_object");
        return review_answer(verdict(uid, true));
    };
    let shoot = state.shoot(namespace);
    let decided = std::panic::catch_unwind(AssertUnwindSafe(|| {
        review(target, shoot.as_deref(), object)
    }))
    .map_err(|_| Failure::Panicked)
    .and_then(|d| d.map_err(|()| Failure::Panicked))
    .and_then(|d| {
        let patch = match &d.patch {
            Some(p) => Some(encode_patch(p).ok_or(Failure::Patch)?),
            None => None,
        };
        Ok((d, patch))
    });
    match decided {
        Ok((decision, patch)) => {
            metrics.admission(label, decision.result);
            review_answer(Response {
                patch_type: patch.is_some().then_some("JSONPatch"),
                patch,
                warnings: decision
                    .warning
                    .map(|w| format!("trellis {label}: {w}"))
                    .into_iter()
                    .collect(),
                ..verdict(uid, true)
            })
        }
        Err(failure) => {
            metrics.admission(label, "failed");
            tracing::warn!(target = label, namespace, %failure, "webhook handler failed");
            let message = format!("trellis {label}: {failure}");
            match policy(target) {
                FailurePolicy::Fail => review_answer(Response {
                    status: Some(Status { code: 500, message }),
                    ..verdict(uid, false)
                }),
                FailurePolicy::Ignore => review_answer(Response {
                    warnings: vec![format!("{message}; admitted unchanged")],
                    ..verdict(uid, true)
                }),
            }
        }
    }
}

/// A bare response: `uid`, `allowed`, nothing else.
fn verdict(uid: &str, allowed: bool) -> Response<'_> {
    Response {
        uid,
        allowed,
        status: None,
        patch_type: None,
        patch: None,
        warnings: Vec::new(),
    }
}

/// The patch as the API server reads it: its JSON, base64-encoded.
fn encode_patch(patch: &json_patch::Patch) -> Option<String> {
    let json = serde_json::to_vec(patch).ok()?;
    Some(base64::engine::general_purpose::STANDARD.encode(json))
}

fn review_answer(response: Response<'_>) -> Answer {
    let out = ReviewOut {
        api_version: API_VERSION,
        kind: "AdmissionReview",
        response,
    };
    match serde_json::to_vec(&out) {
        Ok(body) => Answer {
            status: 200,
            content_type: "application/json",
            body,
            rejection: None,
        },
        // A struct of strings and booleans always encodes; should it not, the API server
        // applies the target's failure policy to a 500.
        Err(_) => Answer::refuse(Rejection::NotAReview, 500, "cannot encode the answer"),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use prometheus_client::encoding::text::encode;
    use prometheus_client::registry::Registry;
    use serde_json::json;

    use super::super::role::ExtensionType;
    use super::super::state::NodeShoot;
    use super::*;

    const NS: &str = "shoot--dev--alpha";
    const API: [u8; 4] = [10, 0, 0, 7];

    fn review_body(uid: &str) -> Vec<u8> {
        serde_json::to_vec(&json!({
            "apiVersion": API_VERSION, "kind": "AdmissionReview",
            "request": {
                "uid": uid,
                "kind": {"group": "apps", "version": "v1", "kind": "DaemonSet"},
                "resource": {"group": "apps", "version": "v1", "resource": "daemonsets"},
                "namespace": "kube-system", "name": "apiserver-proxy", "operation": "CREATE",
                "userInfo": {"username": "system:serviceaccount:kube-system:gardener"},
                "object": {"apiVersion": "apps/v1", "kind": "DaemonSet",
                           "metadata": {"name": "apiserver-proxy", "namespace": "kube-system"}}
            }
        }))
        .unwrap()
    }

    fn state() -> std::sync::Arc<State> {
        let s = State::new();
        s.set_callers(NS, BTreeSet::from([IpAddr::from(API)]));
        s
    }

    fn counted(m: &ExtensionMetrics) -> String {
        let mut r = Registry::default();
        m.register(&mut r);
        let mut text = String::new();
        encode(&mut text, &r).unwrap();
        text
    }

    fn response(a: &Answer) -> Value {
        assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
        let v: Value = serde_json::from_slice(&a.body).unwrap();
        assert_eq!(v["apiVersion"], API_VERSION);
        assert_eq!(v["kind"], "AdmissionReview");
        v["response"].clone()
    }

    fn path() -> String {
        Target::ApiserverProxy.path(NS)
    }

    #[test]
    fn bad_paths_and_bodies_are_refused() {
        let (s, m) = (state(), ExtensionMetrics::new());
        let peer = IpAddr::from(API);
        let a = answer("/shoot/x/unknown", peer, &review_body("u"), &s, &m);
        assert_eq!((a.status, a.rejection), (404, Some(Rejection::NotFound)));
        for body in [
            &b"not json"[..],
            br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#,
            br#"{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview","request":{"uid":"u"}}"#,
            br#"{"apiVersion":"v1","kind":"ConfigMap","request":{"uid":"u"}}"#,
            br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{}}"#,
        ] {
            let a = answer(&path(), peer, body, &s, &m);
            assert_eq!((a.status, a.rejection), (400, Some(Rejection::NotAReview)));
        }
    }

    #[test]
    fn a_caller_of_another_namespace_is_denied_with_the_uid() {
        let (s, m) = (state(), ExtensionMetrics::new());
        s.set_callers(
            "shoot--dev--beta",
            BTreeSet::from([IpAddr::from([10, 0, 0, 8])]),
        );
        for peer in [IpAddr::from([10, 0, 0, 8]), IpAddr::from([127, 0, 0, 1])] {
            let r = response(&answer(&path(), peer, &review_body("u-1"), &s, &m));
            assert_eq!(r["uid"], "u-1");
            assert_eq!(r["allowed"], false);
            assert_eq!(r["status"]["code"], 403);
            assert!(r.get("patch").is_none());
        }
        assert!(
            counted(&m).contains(
                "admissions_total{target=\"apiserver-proxy\",result=\"denied_caller\"} 2"
            )
        );
    }

    #[test]
    fn a_decision_becomes_a_base64_json_patch_with_its_warning() {
        let (s, m) = (state(), ExtensionMetrics::new());
        let patch: json_patch::Patch = serde_json::from_value(json!([
            {"op": "add", "path": "/metadata/labels", "value": {"a": "b"}}
        ]))
        .unwrap();
        let decided = Decision {
            patch: Some(patch.clone()),
            result: "mutated",
            warning: Some("w".into()),
        };
        let a = answer_with(
            &path(),
            IpAddr::from(API),
            &review_body("u-2"),
            &s,
            &m,
            &Target::failure_policy,
            &|_, _, o| {
                assert_eq!(o["metadata"]["name"], "apiserver-proxy");
                Ok(decided.clone())
            },
        );
        let r = response(&a);
        assert_eq!(
            (r["uid"].as_str(), r["allowed"].as_bool()),
            (Some("u-2"), Some(true))
        );
        assert_eq!(r["patchType"], "JSONPatch");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(r["patch"].as_str().unwrap())
            .unwrap();
        let back: json_patch::Patch = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(back, patch);
        assert_eq!(r["warnings"][0], "trellis apiserver-proxy: w");
        assert!(counted(&m).contains("result=\"mutated\"} 1"));
    }

    const GOLDEN: &str =
        include_str!("../../tests/data/extension/apiserver-proxy-ipv4.review.json");

    /// `state()` with the node type configured for `NS`, labelled when `labelled`.
    fn enabled_state(labelled: bool) -> std::sync::Arc<State> {
        let s = state();
        s.update_shoot(NS, |shoot| {
            shoot.configured.insert(ExtensionType::Node);
            if labelled {
                shoot.labelled.insert(ExtensionType::Node);
            }
            shoot.node = Some(NodeShoot {
                image: "ghcr.io/gardener/trellis:v0.9.0".into(),
                config_map: "trellis-node".into(),
                config_digest: "0123abcd".into(),
            });
        });
        s
    }

    fn decoded_patch(r: &Value) -> json_patch::Patch {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(r["patch"].as_str().unwrap())
            .unwrap();
        serde_json::from_slice(&bytes).unwrap()
    }

    #[test]
    fn an_enabled_shoot_gets_the_golden_daemonset_mutated_with_a_patch_that_applies() {
        let (s, m) = (enabled_state(true), ExtensionMetrics::new());
        let a = answer(&path(), IpAddr::from(API), GOLDEN.as_bytes(), &s, &m);
        let r = response(&a);
        assert_eq!(r["uid"], "00000000-0000-4000-8000-000000000000");
        assert_eq!(r["allowed"], true);
        assert_eq!(r["patchType"], "JSONPatch");
        let review: Value = serde_json::from_str(GOLDEN).unwrap();
        let before = review["request"]["object"].clone();
        let mut after = before.clone();
        json_patch::patch(&mut after, &decoded_patch(&r)).unwrap();
        assert_ne!(after, before);
        assert!(
            after
                .to_string()
                .contains("ghcr.io/gardener/trellis:v0.9.0")
        );
        assert!(counted(&m).contains("result=\"mutated\"} 1"));
    }

    #[test]
    fn the_same_namespace_without_the_label_is_not_enabled_and_gets_no_patch() {
        let (s, m) = (enabled_state(false), ExtensionMetrics::new());
        let r = response(&answer(
            &path(),
            IpAddr::from(API),
            GOLDEN.as_bytes(),
            &s,
            &m,
        ));
        assert_eq!(r["allowed"], true);
        assert!(r.get("patch").is_none() && r.get("patchType").is_none());
        assert!(counted(&m).contains("result=\"not_enabled\"} 1"));
    }

    #[test]
    fn with_no_known_kube_apiserver_a_caller_is_admitted_unchanged_never_patched() {
        let m = ExtensionMetrics::new();
        // An enabled shoot whose kube-apiserver pods are not known (yet): the golden
        // DaemonSet that would be mutated, from an address the namespace once had, and from
        // any other.
        let s = enabled_state(true);
        s.set_callers(NS, BTreeSet::new());
        for peer in [IpAddr::from(API), IpAddr::from([192, 168, 9, 9])] {
            let a = answer(&path(), peer, GOLDEN.as_bytes(), &s, &m);
            let r = response(&a);
            assert_eq!(r["uid"], "00000000-0000-4000-8000-000000000000");
            assert_eq!(r["allowed"], true);
            assert!(r.get("patch").is_none() && r.get("patchType").is_none());
            assert!(r.get("status").is_none());
            assert!(
                r["warnings"][0]
                    .as_str()
                    .unwrap()
                    .contains("no kube-apiserver of namespace shoot--dev--alpha known yet")
            );
        }
        // Another namespace's callers being known changes nothing for this one; the mutation
        // is never reached.
        s.set_callers(
            "shoot--dev--beta",
            BTreeSet::from([IpAddr::from([10, 0, 0, 8])]),
        );
        let a = answer_with(
            &path(),
            IpAddr::from([10, 0, 0, 8]),
            &review_body("u-5"),
            &s,
            &m,
            &Target::failure_policy,
            &|_, _, _| panic!("reviewed for an unverified caller"),
        );
        let r = response(&a);
        assert_eq!((r["allowed"].as_bool(), r.get("patch")), (Some(true), None));
        let text = counted(&m);
        assert!(text.contains("result=\"callers_unknown\"} 3"), "{text}");
        assert!(
            !text.contains("result=\"mutated\"") && !text.contains("result=\"failed\""),
            "{text}"
        );
    }

    #[test]
    fn with_known_kube_apiservers_another_caller_is_denied_without_patch() {
        let (s, m) = (enabled_state(true), ExtensionMetrics::new());
        let r = response(&answer(
            &path(),
            IpAddr::from([10, 0, 0, 99]),
            GOLDEN.as_bytes(),
            &s,
            &m,
        ));
        assert_eq!(r["allowed"], false);
        assert_eq!(r["status"]["code"], 403);
        assert!(r.get("patch").is_none());
        let text = counted(&m);
        assert!(text.contains("result=\"denied_caller\"} 1"), "{text}");
        assert!(!text.contains("callers_unknown"), "{text}");
    }

    #[test]
    fn a_handler_failure_follows_the_failure_policy() {
        let s = state();
        for (policy, allowed) in [(FailurePolicy::Fail, false), (FailurePolicy::Ignore, true)] {
            for failing in [
                &(|_: Target, _: Option<&Shoot>, _: &Value| -> Result<Decision, ()> { Err(()) })
                    as Reviewer<'_>,
                &|_, _, _| panic!("a bug in a mutation, with key material -----BEGIN"),
            ] {
                let m = ExtensionMetrics::new();
                let a = answer_with(
                    &path(),
                    IpAddr::from(API),
                    &review_body("u-4"),
                    &s,
                    &m,
                    &|_| policy,
                    failing,
                );
                let r = response(&a);
                assert_eq!(r["uid"], "u-4");
                assert_eq!(r["allowed"], allowed, "{policy:?}");
                assert!(r.get("patch").is_none());
                assert!(!String::from_utf8_lossy(&a.body).contains("BEGIN"));
                assert!(counted(&m).contains("result=\"failed\"} 1"));
            }
        }
    }
}
