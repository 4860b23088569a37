"""The Pod Security Standards as a function: which of ``restricted``, ``baseline``, ``privileged`` a pod passes.

Written from the controls of https://kubernetes.io/docs/concepts/security/pod-security-standards/ (as of
Kubernetes 1.36), each one a check on a pod spec (and its annotations) that names the field that fails,
the way the API server's Pod Security admission reports it. No cluster is needed; the tests call it on
rendered pods (the chart's, the spawner's, a TrainJob's pods as JobSet creates them).
"""

from __future__ import annotations

LEVELS = ("restricted", "baseline", "privileged")
#: baseline: capabilities that may be added (the container runtime's default set)
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE",
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    "KILL",
    "MKNOD",
    "NET_BIND_SERVICE",
    "SETFCAP",
    "SETGID",
    "SETPCAP",
    "SETUID",
    "SYS_CHROOT",
}
SAFE_SYSCTLS = {
    "kernel.shm_rmid_forced",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies",
    "net.ipv4.ping_group_range",
    "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time",
    "net.ipv4.tcp_fin_timeout",
    "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
#: restricted: the only volume sources allowed
RESTRICTED_VOLUMES = {
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "image",
    "persistentVolumeClaim",
    "projected",
    "secret",
}


def _containers(spec: dict):
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for c in spec.get(kind) or []:
            yield f"{kind}[{c.get('name')}]", c


def _baseline(spec: dict, annotations: dict) -> list[str]:
    out = [f"spec.{f}" for f in ("hostNetwork", "hostPID", "hostIPC") if spec.get(f)]
    contexts = [("spec", spec.get("securityContext") or {})]
    contexts += [(where, c.get("securityContext") or {}) for where, c in _containers(spec)]
    for where, sc in contexts:
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"{where}: hostProcess")
        selinux = sc.get("seLinuxOptions") or {}
        if selinux.get("type", "") not in SELINUX_TYPES or selinux.get("user") or selinux.get("role"):
            out.append(f"{where}: seLinuxOptions")
        for profile in ("seccompProfile", "appArmorProfile"):
            if (sc.get(profile) or {}).get("type") == "Unconfined":
                out.append(f"{where}: {profile} Unconfined")
    for where, c in _containers(spec):
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"{where}: privileged")
        added = set((sc.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
        if added:
            out.append(f"{where}: capabilities.add {sorted(added)}")
        if any(p.get("hostPort") for p in c.get("ports") or []):
            out.append(f"{where}: hostPort")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"{where}: procMount")
        for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
            handler = c.get(probe) or {}
            if any((handler.get(h) or {}).get("host") for h in ("httpGet", "tcpSocket")):
                out.append(f"{where}: {probe} host")
    out += [f"volume {v.get('name')}: hostPath" for v in spec.get("volumes") or [] if "hostPath" in v]
    sysctls = (spec.get("securityContext") or {}).get("sysctls") or []
    out += [f"sysctl {s.get('name')}" for s in sysctls if s.get("name") not in SAFE_SYSCTLS]
    for key, value in (annotations or {}).items():
        if key.startswith("container.apparmor.security.beta.kubernetes.io/") and not (
            value == "runtime/default" or value.startswith("localhost/")
        ):
            out.append(f"annotation {key}")
    return out


def _restricted(spec: dict) -> list[str]:
    out = []
    for v in spec.get("volumes") or []:
        kinds = set(v) - {"name"} - RESTRICTED_VOLUMES
        if kinds:
            out.append(f"volume {v.get('name')}: {sorted(kinds)}")
    pod = spec.get("securityContext") or {}
    if pod.get("runAsNonRoot") is False:
        out.append("spec: runAsNonRoot false")
    if pod.get("runAsUser") == 0:
        out.append("spec: runAsUser 0")
    for where, c in _containers(spec):
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation != false")
        if sc.get("runAsNonRoot", pod.get("runAsNonRoot")) is not True:
            out.append(f"{where}: runAsNonRoot != true")
        if sc.get("runAsUser") == 0:
            out.append(f"{where}: runAsUser 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type") or (pod.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{where}: seccompProfile {seccomp}")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{where}: capabilities.drop lacks ALL")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            out.append(f"{where}: capabilities.add beyond NET_BIND_SERVICE")
    return out


def violations(spec: dict, level: str = "restricted", annotations: dict | None = None) -> list[str]:
    """What of ``spec`` (a PodSpec) the ``level`` refuses; [] when it passes."""
    if level == "privileged":
        return []
    out = _baseline(spec, annotations or {})
    return out + _restricted(spec) if level == "restricted" else out


def level(spec: dict, annotations: dict | None = None) -> str:
    """The strictest level the pod passes."""
    return next(lvl for lvl in LEVELS if not violations(spec, lvl, annotations))


def pod_specs(objects: list[dict]):
    """``(name, pod spec, annotations)`` of every pod and pod template among rendered objects."""
    for o in objects:
        kind = o.get("kind")
        if kind == "Pod":
            yield o["metadata"]["name"], o["spec"], o["metadata"].get("annotations")
        elif kind in ("Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"):
            template = o["spec"]["template"]
            yield (
                f"{kind}/{o['metadata']['name']}",
                template["spec"],
                (template.get("metadata") or {}).get("annotations"),
            )
