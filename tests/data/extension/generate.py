#!/usr/bin/env python3
"""Writes the AdmissionReview inputs of tests/extension_mutate.rs (see README.md).

Each object is transcribed from gardener/gardener v1.149.3 (the Go structs it builds, then
what the API server adds before admission: defaults, uid, generation). Run from this
directory: `python3 generate.py`. The expected outputs in expected/ are written by the
test with TRELLIS_BLESS=1 and reviewed by hand.
"""
import copy, hashlib, json

NS = "shoot--dev--alpha"
SIDECAR_IMAGE = "europe-docker.pkg.dev/gardener-project/releases/gardener/apiserver-proxy:v0.21.0"
ENVOY_IMAGE = "europe-docker.pkg.dev/gardener-project/releases/3rd/envoyproxy/envoy:distroless-v1.39.0"


def reference_key(kind, name):
    # pkg/resourcemanager/controller/garbagecollector/references/references.go AnnotationKey
    return "reference.resources.gardener.cloud/" + kind + "-" + hashlib.sha256(name.encode()).hexdigest()[:8]


def defaulted_container(c):
    # What the API server's defaulting adds to every container (k8s.io/kubernetes
    # pkg/apis/core/v1/defaults.go): terminationMessage*, port protocol, probe fields.
    c.setdefault("terminationMessagePath", "/dev/termination-log")
    c.setdefault("terminationMessagePolicy", "File")
    for p in c.get("ports", []):
        p.setdefault("protocol", "TCP")
    for probe in ("readinessProbe", "livenessProbe"):
        if probe in c:
            c[probe]["httpGet"].setdefault("scheme", "HTTP")
            c[probe].setdefault("failureThreshold", 3)
    return c


def apiserver_proxy(ip, config_map_hash):
    """pkg/component/networking/apiserverproxy/apiserver_proxy.go computeResourcesData."""
    config_map = "apiserver-proxy-config-" + config_map_hash  # kubernetesutils.MakeUnique
    refs = {reference_key("configmap", config_map): config_map}  # references.InjectAnnotations
    selector = {"app": "kubernetes", "role": "apiserver-proxy"}
    default_labels = {"gardener.cloud/role": "system-component", "origin": "gardener", **selector}
    return {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {
            "name": "apiserver-proxy",
            "namespace": "kube-system",
            "uid": "5d0b9c1e-8a3f-4d4e-9a51-0e7d2b7c9f10",
            "generation": 3,
            "creationTimestamp": "2026-11-01T09:00:00Z",
            "labels": {**default_labels, "node.gardener.cloud/critical-component": "true"},
            "annotations": {**refs, "resources.gardener.cloud/origin": "shoot--dev--alpha/shoot-core-apiserver-proxy",
                            "deprecated.daemonset.template.generation": "3"},
        },
        "spec": {
            "revisionHistoryLimit": 2,
            "selector": {"matchLabels": selector},
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}},
            "template": {
                "metadata": {
                    "creationTimestamp": None,
                    "annotations": dict(refs),
                    "labels": {
                        **default_labels,
                        "node.gardener.cloud/critical-component": "true",
                        "networking.gardener.cloud/to-dns": "allowed",
                        "networking.gardener.cloud/to-apiserver": "allowed",
                        "networking.gardener.cloud/from-seed": "allowed",
                    },
                },
                "spec": {
                    "serviceAccountName": "apiserver-proxy",
                    "serviceAccount": "apiserver-proxy",
                    "priorityClassName": "system-node-critical",
                    "priority": 2000001000,
                    "tolerations": [
                        {"effect": "NoSchedule", "operator": "Exists"},
                        {"effect": "NoExecute", "operator": "Exists"},
                    ],
                    "hostNetwork": True,
                    "automountServiceAccountToken": False,
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "dnsPolicy": "ClusterFirst",
                    "restartPolicy": "Always",
                    "schedulerName": "default-scheduler",
                    "terminationGracePeriodSeconds": 30,
                    "initContainers": [defaulted_container({
                        "name": "setup",
                        "image": SIDECAR_IMAGE,
                        "imagePullPolicy": "IfNotPresent",
                        "args": ["--ip-address=" + ip, "--daemon=false", "--interface=apiserver-proxy"],
                        "resources": {"requests": {"cpu": "20m", "memory": "20Mi"}},
                        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"add": ["NET_ADMIN"]}},
                    })],
                    "containers": [
                        defaulted_container({
                            "name": "sidecar",
                            "image": SIDECAR_IMAGE,
                            "imagePullPolicy": "IfNotPresent",
                            "args": ["--ip-address=" + ip, "--interface=apiserver-proxy"],
                            "resources": {"requests": {"cpu": "5m", "memory": "15Mi"}},
                            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"add": ["NET_ADMIN"]}},
                        }),
                        defaulted_container({
                            "name": "proxy",
                            "image": ENVOY_IMAGE,
                            "imagePullPolicy": "IfNotPresent",
                            "command": ["envoy", "--concurrency", "2", "--use-dynamic-base-id", "-c", "/etc/apiserver-proxy/envoy.yaml"],
                            "resources": {"requests": {"cpu": "5m", "memory": "30Mi"}},
                            "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"add": ["NET_BIND_SERVICE"]}, "runAsUser": 0},
                            "readinessProbe": {"httpGet": {"path": "/ready", "port": 16910}, "initialDelaySeconds": 1, "periodSeconds": 2, "successThreshold": 1, "timeoutSeconds": 1},
                            "livenessProbe": {"httpGet": {"path": "/ready", "port": 16910}, "initialDelaySeconds": 1, "periodSeconds": 10, "successThreshold": 1, "timeoutSeconds": 1, "failureThreshold": 3},
                            "ports": [{"name": "metrics", "containerPort": 16910, "hostPort": 16910}],
                            "volumeMounts": [
                                {"name": "proxy-config", "mountPath": "/etc/apiserver-proxy"},
                                {"name": "admin-uds", "mountPath": "/etc/admin-uds"},
                            ],
                        }),
                    ],
                    "volumes": [
                        {"name": "proxy-config", "configMap": {"name": config_map, "defaultMode": 420}},
                        {"name": "admin-uds", "emptyDir": {}},
                    ],
                },
            },
        },
    }


def vpn_seed_server():
    """pkg/component/networking/vpn/seedserver/seedserver.go podTemplate (non-HA: a
    Deployment; env, probes and the envoy container abbreviated)."""
    labels = {"gardener.cloud/role": "controlplane", "app": "vpn-seed-server"}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "vpn-seed-server", "namespace": NS, "labels": labels, "uid": "0a7f2d8e-3c6b-4f0e-b2a1-6e5d4c3b2a19"},
        "spec": {
            "replicas": 1, "revisionHistoryLimit": 1,
            "selector": {"matchLabels": {"app": "vpn-seed-server"}},
            "template": {
                "metadata": {"labels": {**labels, "networking.gardener.cloud/to-dns": "allowed",
                                        "networking.gardener.cloud/to-private-networks": "allowed",
                                        "networking.resources.gardener.cloud/to-kube-apiserver-tcp-443": "allowed"}},
                "spec": {
                    "automountServiceAccountToken": False,
                    "priorityClassName": "gardener-system-300",
                    "dnsPolicy": "Default",
                    "initContainers": [defaulted_container({
                        "name": "setup", "image": "europe-docker.pkg.dev/gardener-project/releases/gardener/vpn-server:0.51.0",
                        "imagePullPolicy": "IfNotPresent", "command": ["/bin/vpn-server", "setup"],
                        "securityContext": {"privileged": True}})],
                    "containers": [
                        defaulted_container({
                            "name": "vpn-seed-server", "image": "europe-docker.pkg.dev/gardener-project/releases/gardener/vpn-server:0.51.0",
                            "imagePullPolicy": "IfNotPresent",
                            "ports": [{"name": "tcp-tunnel", "containerPort": 1194}],
                            "env": [{"name": "IP_FAMILIES", "value": "IPv4"}, {"name": "OPENVPN_STATUS_PATH", "value": "/srv/status/openvpn.status"}],
                            "securityContext": {"capabilities": {"add": ["NET_ADMIN", "NET_RAW"]}},
                            "volumeMounts": [{"name": "dev-net-tun", "mountPath": "/dev/net/tun"},
                                             {"name": "certs", "mountPath": "/srv/secrets/vpn-server"},
                                             {"name": "tlsauth", "mountPath": "/srv/secrets/tlsauth"},
                                             {"name": "openvpn-status", "mountPath": "/srv/status"}]}),
                        defaulted_container({
                            "name": "envoy-proxy", "image": ENVOY_IMAGE, "imagePullPolicy": "IfNotPresent",
                            "command": ["envoy", "--concurrency", "2", "-c", "/etc/envoy/envoy.yaml"],
                            "ports": [{"name": "http-proxy", "containerPort": 9443}, {"name": "metrics", "containerPort": 15000}],
                            "volumeMounts": [{"name": "certs", "mountPath": "/srv/secrets/vpn-server"},
                                             {"name": "envoy-config", "mountPath": "/etc/envoy"}]}),
                    ],
                    "volumes": [
                        {"name": "dev-net-tun", "hostPath": {"path": "/dev/net/tun", "type": "CharDevice"}},
                        {"name": "certs", "projected": {"defaultMode": 256, "sources": [{"secret": {"name": "ca-vpn-5b9d0c7a", "items": [{"key": "bundle.crt", "path": "ca.crt"}]}}, {"secret": {"name": "vpn-seed-server-2f6a1e0b"}}]}},
                        {"name": "tlsauth", "secret": {"secretName": "vpn-seed-server-tlsauth-a1b2c3d4", "defaultMode": 256}},
                        {"name": "openvpn-status", "emptyDir": {}},
                        {"name": "envoy-config", "configMap": {"name": "vpn-seed-server-envoy-config", "defaultMode": 420}},
                    ],
                },
            },
        },
    }


def vpn_shoot():
    """pkg/component/networking/vpn/shoot/shoot.go podTemplate and container (non-HA:
    a Deployment; env abbreviated)."""
    labels = {"gardener.cloud/role": "system-component", "app": "vpn-shoot", "origin": "gardener", "type": "tunnel"}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "vpn-shoot", "namespace": "kube-system", "uid": "7c1e4b2a-9d8f-4e3c-a6b5-1f0e9d8c7b6a",
                     "labels": {"gardener.cloud/role": "system-component", "app": "vpn-shoot", "origin": "gardener"}},
        "spec": {
            "replicas": 1, "revisionHistoryLimit": 2,
            "selector": {"matchLabels": {"app": "vpn-shoot"}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "automountServiceAccountToken": False, "serviceAccountName": "vpn-shoot",
                    "priorityClassName": "system-cluster-critical", "dnsPolicy": "Default",
                    "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
                    "initContainers": [defaulted_container({
                        "name": "vpn-shoot-init", "image": "europe-docker.pkg.dev/gardener-project/releases/gardener/vpn-client:0.51.0",
                        "imagePullPolicy": "IfNotPresent", "command": ["/bin/vpn-client", "setup"],
                        "securityContext": {"privileged": True}})],
                    "containers": [defaulted_container({
                        "name": "vpn-shoot", "image": "europe-docker.pkg.dev/gardener-project/releases/gardener/vpn-client:0.51.0",
                        "imagePullPolicy": "IfNotPresent",
                        "env": [{"name": "ENDPOINT", "value": "api.alpha.dev.internal.example.com"}, {"name": "OPENVPN_PORT", "value": "8132"},
                                {"name": "REVERSED_VPN_HEADER", "value": "outbound|1194||vpn-seed-server.shoot--dev--alpha.svc.cluster.local"}],
                        "resources": {"requests": {"cpu": "100m", "memory": "100Mi"}},
                        "securityContext": {"privileged": False, "allowPrivilegeEscalation": False, "capabilities": {"add": ["NET_ADMIN"]}},
                        "volumeMounts": [{"name": "vpn-shoot", "mountPath": "/srv/secrets/vpn-client"},
                                         {"name": "vpn-shoot-tlsauth", "mountPath": "/srv/secrets/tlsauth"},
                                         {"name": "dev-net-tun", "mountPath": "/dev/net/tun"}]})],
                    "volumes": [
                        {"name": "vpn-shoot", "projected": {"defaultMode": 256, "sources": [{"secret": {"name": "vpn-shoot-client-3e4f5a6b"}}, {"secret": {"name": "vpn-shoot-ca-7a8b9c0d"}}]}},
                        {"name": "vpn-shoot-tlsauth", "secret": {"secretName": "vpn-shoot-tlsauth-1a2b3c4d", "defaultMode": 256}},
                        {"name": "dev-net-tun", "hostPath": {"path": "/dev/net/tun", "type": "CharDevice"}},
                    ],
                },
            },
        },
    }


def kube_apiserver():
    """pkg/component/kubernetes/apiserver/deployment.go (labels app=kubernetes,
    role=apiserver; command, volumes and probes abbreviated)."""
    labels = {"app": "kubernetes", "role": "apiserver", "gardener.cloud/role": "controlplane"}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "kube-apiserver", "namespace": NS, "labels": labels, "uid": "3f2e1d0c-b9a8-4766-8554-433221100ffe"},
        "spec": {
            "replicas": 2, "revisionHistoryLimit": 2, "minReadySeconds": 30,
            "selector": {"matchLabels": {"app": "kubernetes", "role": "apiserver"}},
            "template": {
                "metadata": {"labels": {**labels, "networking.gardener.cloud/to-dns": "allowed"}},
                "spec": {
                    "priorityClassName": "gardener-system-500", "schedulerName": "default-scheduler",
                    "automountServiceAccountToken": False,
                    "containers": [defaulted_container({
                        "name": "kube-apiserver", "image": "registry.k8s.io/kube-apiserver:v1.33.5",
                        "imagePullPolicy": "IfNotPresent",
                        "command": ["/usr/local/bin/kube-apiserver"],
                        "args": ["--advertise-address=10.4.12.34", "--secure-port=443",
                                 "--egress-selector-config-file=/etc/kubernetes/egress/egress-selector-configuration.yaml"],
                        "ports": [{"name": "https", "containerPort": 443}],
                        "volumeMounts": [{"name": "ca", "mountPath": "/srv/kubernetes/ca"}]})],
                    "volumes": [{"name": "ca", "secret": {"secretName": "ca-4b3a2c1d", "defaultMode": 416}}],
                },
            },
        },
    }


def review(obj, operation, uid):
    group, version = obj["apiVersion"].split("/")
    resource = obj["kind"].lower() + "s"
    req = {
        "uid": uid,
        "kind": {"group": group, "version": version, "kind": obj["kind"]},
        "resource": {"group": group, "version": version, "resource": resource},
        "requestKind": {"group": group, "version": version, "kind": obj["kind"]},
        "requestResource": {"group": group, "version": version, "resource": resource},
        "name": obj["metadata"]["name"],
        "namespace": obj["metadata"]["namespace"],
        "operation": operation,
        "userInfo": {"username": "system:serviceaccount:kube-system:gardener-resource-manager",
                     "groups": ["system:serviceaccounts", "system:serviceaccounts:kube-system", "system:authenticated"]},
        "object": obj,
        "oldObject": copy.deepcopy(obj) if operation == "UPDATE" else None,
        "dryRun": False,
        "options": {"kind": "UpdateOptions" if operation == "UPDATE" else "CreateOptions", "apiVersion": "meta.k8s.io/v1",
                    "fieldManager": "gardener-resource-manager"},
    }
    return {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": req}


def other_webhooks(obj):
    """The IPv4 DaemonSet after other webhooks and a newer API server: labels, annotations,
    a sidecar of its own, a node selector, and fields this code does not know."""
    o = copy.deepcopy(obj)
    o["metadata"]["labels"]["example.com/team"] = "platform"
    o["metadata"]["annotations"]["example.com/checked"] = "true"
    o["metadata"]["managedFields"] = [{"manager": "gardener-resource-manager", "operation": "Apply", "apiVersion": "apps/v1",
                                       "time": "2026-11-01T09:00:00Z", "fieldsType": "FieldsV1", "fieldsV1": {"f:spec": {}}}]
    o["spec"]["futureSpecField"] = {"enabled": True}
    t = o["spec"]["template"]
    t["metadata"]["annotations"]["example.com/injected"] = "log-shipper"
    s = t["spec"]
    s["futurePodField"] = ["kept", {"nested": 1}]
    s["nodeSelector"] = {"worker.gardener.cloud/system-components": "true"}
    s["containers"].insert(0, defaulted_container({
        "name": "log-shipper", "image": "example.com/log-shipper:1.0", "futureContainerField": "kept",
        "volumeMounts": [{"name": "shipper-state", "mountPath": "/var/lib/shipper"}]}))
    s["initContainers"].append(defaulted_container({"name": "prepare-shipper", "image": "example.com/log-shipper:1.0"}))
    s["volumes"].append({"name": "shipper-state", "emptyDir": {"sizeLimit": "10Mi"}})
    return o


FILES = {
    # advertise address: mapToReservedKubeApiServerRange of the seed's ClusterIP 10.4.12.34
    "apiserver-proxy-ipv4": (apiserver_proxy("240.4.12.34", "3c1a5f0e"), "CREATE"),
    # PreferIPv6 with an IPv4 ClusterIP: "64:ff9b:1::" + "10.4.12.34" (as Gardener writes it)
    "apiserver-proxy-ipv6": (apiserver_proxy("64:ff9b:1::10.4.12.34", "9e8d7c6b"), "UPDATE"),
    # Istio TLS termination: same DaemonSet, an Envoy config (and so ConfigMap hash) of its own
    "apiserver-proxy-tls-termination": (apiserver_proxy("240.4.12.34", "5f4e3d2c"), "UPDATE"),
    "apiserver-proxy-other-webhooks": (other_webhooks(apiserver_proxy("240.4.12.34", "3c1a5f0e")), "UPDATE"),
    "vpn-seed-server": (vpn_seed_server(), "UPDATE"),
    "vpn-shoot": (vpn_shoot(), "UPDATE"),
    "kube-apiserver": (kube_apiserver(), "UPDATE"),
}

for i, (name, (obj, op)) in enumerate(sorted(FILES.items())):
    with open(name + ".review.json", "w") as f:
        json.dump(review(obj, op, "00000000-0000-4000-8000-%012d" % i), f, indent=2)
        f.write("\n")
